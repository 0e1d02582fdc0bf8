"""`albert convert`: an albert model directory <-> a transformers checkpoint directory, tokenizer included.

The weights go through `albert_core.model.interop` (explicit key maps). The tokenizer goes with them: spiece.model, the
tokenizer_config.json transformers' AlbertTokenizer reads (do_lower_case and keep_accents as ours, our special
tokens, token_type_ids among its outputs) and special_tokens_map.json, so `AutoTokenizer.from_pretrained(out)`
gives the ids `albert_core.text.tokenization.Tokenizer` gives; a WordPiece tokenizer (BERT) writes its own vocab.txt,
tokenizer.json, tokenizer_config.json and special_tokens_map.json. It is the `tokenizer` given, else the one in or
above the source directory (where `albert finetune` looks: a pretraining run keeps it in its run directory),
checked against the checkpoint's vocabulary first.

The direction follows from the source (a config.json with "model_type" is transformers'); converting into the
source's own format is refused, and so is a non-empty output directory unless `force`, which first removes the
model and tokenizer files found there, so none of an older checkpoint mixes with the new one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from albert_core.files import CHECKSUM_FILE, LEGACY_CHECKSUM_FILE, TRAINER_FILE, CheckpointError, atomic_write_bytes
from albert_core.model.checkpoint import CONFIG_FILE, load_weights, read_checkpoint, save_model
from albert_core.model.interop import config_to_hf, save_hf_checkpoint
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.text.tokenization import CLS, MASK, MODEL_FILE, PAD, SEP, UNK, AnyTokenizer, load_tokenizer
from albert_core.text.vocabulary import (
    SENTENCEPIECE,
    WORDPIECE_FILE,
    Vocabulary,
    check_vocabulary,
    find_tokenizer,
    tokenizer_candidates,
)

FORMATS = {"albert": "an albert model directory", "hf": "a transformers checkpoint"}
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
SPECIAL_TOKENS = {
    "bos_token": CLS,
    "eos_token": SEP,
    "unk_token": UNK,
    "sep_token": SEP,
    "pad_token": PAD,
    "cls_token": CLS,
    "mask_token": MASK,
}
# Model and tokenizer files of either format (transformers reads tokenizer.json before spiece.model, so a stale one
# would silently win): what `force` removes from the output before writing.
_CHECKPOINT_FILES = frozenset(
    {
        *("config.json", "generation_config.json", "pytorch_model.bin", "tf_model.h5", "flax_model.msgpack"),
        *("spiece.model", "spiece.vocab", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"),
        *("added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "sentencepiece.bpe.model"),
        *(TRAINER_FILE, CHECKSUM_FILE, LEGACY_CHECKSUM_FILE),
    }
)
_CHECKPOINT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin.index.json")


@dataclass(frozen=True)
class Conversion:
    """What `convert_checkpoint` wrote."""

    output: Path
    to: str  # "hf" | "albert"
    tokenizer: AnyTokenizer | None  # the tokenizer written with the weights; None: the output has none
    replaced: int = 0  # files of an earlier checkpoint removed from the output (force)
    warning: str | None = None  # one line when the output has no tokenizer

    def summary(self) -> str:
        tok = self.tokenizer
        if tok is None:
            carried = "no tokenizer"
        else:
            casing = "lower-cased" if tok.lower_case else "cased"
            carried = f"tokenizer {tok.name}: {tok.vocab_size} pieces, {casing}"
        replaced = f"; replaced {self.replaced} files of an earlier checkpoint" if self.replaced else ""
        return f"wrote {self.to} checkpoint to {self.output} ({carried}{replaced})"


def source_format(directory: str | Path) -> str:
    """The format of a model directory: "hf" when config.json has "model_type" (transformers), else "albert"."""
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found; convert reads {FORMATS['albert']} or {FORMATS['hf']}") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return "hf" if "model_type" in raw else "albert"


def target_format(source: str | Path, to: str | None) -> str:
    """The format to write: `to`, or the other one than the source's; the source's own format is refused."""
    have = source_format(source)
    other = "albert" if have == "hf" else "hf"
    if to is None:
        return other
    if to not in FORMATS:
        raise ValueError(f"--to: expected one of {', '.join(FORMATS)}, got {to!r}")
    if to == have:
        raise ValueError(f"{source} is already {FORMATS[have]}; nothing to convert (--to {other} converts it)")
    return to


def check_output(source: str | Path, output: str | Path, *, force: bool = False) -> list[Path]:
    """Refuse an output that is the source, a file, or a non-empty directory (unless `force`). Returns the model
    and tokenizer files already there, which the conversion removes before it writes."""
    source, output = Path(source), Path(output)
    if output.exists() and output.resolve() == source.resolve():
        raise ValueError(f"{output}: the output directory is the source; write the conversion somewhere else")
    if output.exists() and not output.is_dir():
        raise ValueError(f"{output}: exists and is not a directory")
    entries = sorted(output.iterdir()) if output.is_dir() else []
    if entries and not force:
        names = ", ".join(p.name for p in entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ValueError(f"{output}: not empty ({names}); choose an empty directory or pass --force to replace it")
    return [p for p in entries if p.is_file() and _is_checkpoint_file(p.name)]


def _is_checkpoint_file(name: str) -> bool:
    return name in _CHECKPOINT_FILES or name.endswith(_CHECKPOINT_SUFFIXES)


def resolve_tokenizer(source: str | Path, tokenizer: str | Path | None = None) -> tuple[AnyTokenizer | None, str]:
    """The tokenizer to carry (the one given, else the spiece.model or WordPiece vocabulary in or above `source`), or
    None and why not."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer), ""
    found = find_tokenizer(source)
    if found is not None:
        return load_tokenizer(found), ""
    where = ", ".join(str(p) for p in tokenizer_candidates(source))
    return None, f"found no {MODEL_FILE} or WordPiece {WORDPIECE_FILE} / tokenizer.json in {where}"


def write_tokenizer(tokenizer: AnyTokenizer, directory: str | Path, *, model_max_length: int) -> Path:
    """The tokenizer's files with special_tokens_map.json, for us and transformers: spiece.model, spiece.vocab and
    tokenizer_config.json (SentencePiece, with ALBERT's special tokens), or vocab.txt, tokenizer.json and
    tokenizer_config.json (WordPiece, which writes its own special tokens)."""
    path = tokenizer.save(directory, model_max_length=model_max_length)
    if tokenizer.kind == SENTENCEPIECE:
        special = json.dumps(SPECIAL_TOKENS, indent=2) + "\n"
        atomic_write_bytes(Path(directory) / SPECIAL_TOKENS_FILE, special.encode("utf-8"))
    return path


def convert_checkpoint(
    source: str | Path,
    output: str | Path,
    *,
    to: str | None = None,
    tokenizer: str | Path | None = None,
    force: bool = False,
) -> Conversion:
    """Convert `source` (ours or transformers') into `output` in the other format (or `to`), tokenizer included.

    Everything is checked before the output is touched: the formats, the output directory, the tokenizer against
    the checkpoint's vocabulary, and (for transformers) that the model has a transformers equivalent."""
    target = target_format(source, to)
    stale = check_output(source, output, force=force)
    carried, why_none = resolve_tokenizer(source, tokenizer)
    if carried is not None:
        check_vocabulary(source, Vocabulary.of(carried))
    config, state = read_checkpoint(source)
    if target == "hf":
        config_to_hf(config)  # raises for a model transformers cannot express (pre-LN, partial sharing)
    for path in stale:
        path.unlink()
    if target == "hf":
        save_hf_checkpoint(output, state, config)
    else:
        model = AlbertForPreTraining(config)
        load_weights(model, state)
        save_model(output, model)
    warning = None
    if carried is not None:
        write_tokenizer(carried, output, model_max_length=config.max_position_embeddings)
    else:
        warning = (
            f"{output} has no tokenizer ({why_none}); to add one, rerun with --tokenizer PATH/{MODEL_FILE} --force "
            f"(the SentencePiece model of this checkpoint's {config.vocab_size} pieces)"
        )
    return Conversion(Path(output), target, carried, len(stale), warning)
