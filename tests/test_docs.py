"""The documentation says what the code does: README.md is a front page (its two commands first, at most 150
lines, nothing linked outside the repository), the numbers it states are the code's, and the suite runs away from
the checkout so that what the main job leaves there cannot change a test's outcome."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOC_PATH = re.compile(r"\b((?:docs/[\w-]+|deploy|README)\.md)\b")


def test_readme_is_a_front_page_with_the_two_commands_first():
    lines = README.splitlines()
    assert len(lines) <= 150
    assert lines[0] == "# albert"
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split("#")[0].strip() for line in first_block] == ["bash scripts/main.sh", "bash scripts/test.sh"]
    assert README.index("```bash") < README.index("\n## ")


def test_readme_links_nothing_outside_the_repository_and_every_page_it_names_exists():
    assert "../" not in README
    assert not re.search(r"\]\((?!reports/|docs/|deploy\.md)", README), "a link that is not a file of the repository"
    named = set(DOC_PATH.findall(README))
    assert {"docs/guide.md", "docs/design.md", "deploy.md"} <= named
    assert [page for page in sorted(named) if not (ROOT / page).is_file()] == []


def test_the_numbers_readme_states_are_the_codes():
    from services.demo import HELDOUT_FRACTION, run_demo
    from services.preprocess.config import PreprocessConfig
    from services.rundir.config import RunConfig

    tiny = RunConfig.load("tiny")
    held = re.search(
        r"holds out (\d+)% of the\s+documents \(`--heldout-fraction ([\d.]+)`; the command's default is (\d+)%\)",
        README,
    )
    assert held, "README no longer says what share of the documents the demo holds out"
    assert float(held.group(1)) / 100 == float(held.group(2)) == HELDOUT_FRACTION
    assert float(held.group(3)) / 100 == PreprocessConfig.__dataclass_fields__["heldout_fraction"].default
    pieces = re.search(r"a SentencePiece unigram model of ([\d,]+) pieces", README)
    assert int(pieces.group(1).replace(",", "")) == inspect.signature(run_demo).parameters["vocab_size"].default
    steps = re.search(
        r"([\d,]+) steps on (\d+) Ray Train workers, a checkpoint and a held-out evaluation every\s+(\d+)", README
    )
    assert int(steps.group(1).replace(",", "")) == tiny.optim.total_steps
    assert int(steps.group(2)) == tiny.train.num_workers
    assert int(steps.group(3)) == tiny.train.checkpoint_every == tiny.eval.every_steps


def test_the_suite_runs_outside_the_checkout():
    """tests/conftest.py moves every test to a scratch directory: `.cache/albert/` and `runs/` left in the checkout
    by `bash scripts/main.sh` are not what a test's relative paths resolve to."""
    assert not Path.cwd().resolve().is_relative_to(ROOT)
    assert not (Path.cwd() / ".cache").exists()


def test_the_design_names_an_existing_owner_for_each_concept():
    design = (ROOT / "docs" / "design.md").read_text()
    owners = design.split("## One owner for each concept", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in owners.splitlines() if line.startswith("| ") and not line.startswith("| concept")]
    concepts = {row.split("|")[1].strip() for row in rows}
    for concept in ("a run's checkpoints", "evaluation on a run", "from a command to the workers", "Ray start-up"):
        assert concept in concepts
    assert {"the example shape", "the masks"} <= concepts
    named = set(re.findall(r"`((?:albert_core|services|tests)/[\w/]+\.py)", design))
    assert [path for path in sorted(named) if not (ROOT / path).is_file()] == []
