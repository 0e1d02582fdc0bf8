"""Markdown tables of the recipe-search cells (reports/recipe-search/round*.jsonl): one row per cell, with its held-out
MLM accuracy at each evaluation point of its budget and the unigram baseline on the same positions.

    python reports/recipe-search/summarize.py [FILES...]   (default: every round*.jsonl beside this script)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cells(paths: list[Path]) -> list[tuple[str, dict]]:
    out = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                out.append((path.stem, json.loads(line)))
    return out


def row(round_name: str, cell: dict) -> str:
    curve = cell["curve"]
    points = " / ".join(f"{p['mlm_acc']:.3f}" for p in curve[1:])
    final = cell["final"]
    return (
        f"| {round_name} | {cell['name']} | {cell['steps']} | {cell['epochs']:.2f} | {points} | "
        f"{final['mlm_acc']:.4f} | {final['unigram_acc']:.4f} | {final['mlm_margin']:+.4f} | {final['mlm_loss']:.3f} | "
        f"{final['sop_acc']:.3f} |"
    )


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or sorted(HERE.glob("round*.jsonl"), key=lambda p: int(p.stem[5:]))
    print(
        "| round | cell | steps | epochs | held-out MLM acc at 1/5 .. 5/5 of the budget | final MLM acc | unigram "
        "| margin | MLM loss | SOP acc |"
    )
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for round_name, cell in cells(paths):
        print(row(round_name, cell))


if __name__ == "__main__":
    main()
