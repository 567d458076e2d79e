"""`ckpt export`: a checkpoint as Hugging Face style safetensors (ckpt.safetensors.export)."""

from __future__ import annotations

import json
import re
from typing import Callable

from ckpt.safetensors import ExportResult

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_shard_size(text: str) -> int:
    """A size as transformers' ``max_shard_size`` reads it: '5GB' is 5 * 10**9, '2GiB' 2 * 2**30,
    '500MB', '100000' (bytes). ValueError for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"bad size {text!r} (e.g. 5GB, 500MB, 2GiB, 100000)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"bad size {text!r}: must be at least 1 byte")
    return size


def rename_from(rules: list[str], mapping_file: str | None) -> Callable[[str], str | None] | None:
    """The rename of `ckpt export`: first the mapping file (a JSON object from default names to
    names, null dropping the tensor), then each rule 'PATTERN=REPLACEMENT' in order (Python
    ``re.sub``; a name that becomes empty is dropped). ValueError naming a bad rule or file."""
    compiled = []
    for rule in rules:
        pattern, sep, replacement = rule.partition("=")
        if not sep or not pattern:
            raise ValueError(f"bad --rename rule {rule!r} (PATTERN=REPLACEMENT, e.g. '^params\\.=model.')")
        try:
            compiled.append((re.compile(pattern), replacement))
        except re.error as e:
            raise ValueError(f"bad --rename rule {rule!r}: {e}") from None
    mapping: dict[str, str | None] = {}
    if mapping_file is not None:
        try:
            with open(mapping_file, encoding="utf-8") as f:
                mapping = json.load(f)
        except ValueError as e:
            raise ValueError(f"--rename-file {mapping_file}: not JSON ({e})") from None
        if not isinstance(mapping, dict) or not all(isinstance(v, str) or v is None for v in mapping.values()):
            raise ValueError(f"--rename-file {mapping_file}: expected a JSON object of names to names (or null)")
    if not compiled and mapping_file is None:
        return None

    def rename(name: str) -> str | None:
        new = mapping.get(name, name)
        for pattern, replacement in compiled:
            if new is None:
                break
            try:
                new = pattern.sub(replacement, new)
            except (re.error, IndexError) as e:
                raise ValueError(f"--rename {pattern.pattern!r}={replacement!r} on {name!r}: {e}") from None
        return new or None

    return rename


def export_document(result: ExportResult, out: str, source: str) -> dict:
    return {"source": source, "out": out, "files": list(result.files), "tensors": result.tensors,
            "bytes": result.bytes, "skipped": list(result.skipped), "dropped": list(result.dropped)}


def render_export(doc: dict) -> str:
    from ckpt.cli._render import human_bytes, plural

    files = doc["files"]
    lines = [f"exported {plural(len(doc['tensors']), 'tensor')} ({human_bytes(doc['bytes'])}) of {doc['source']}",
             f"to {doc['out']} in {len(files)} file(s):"]
    lines += [f"  {f}" for f in files]
    if doc["skipped"]:
        lines.append(f"not tensors, not exported ({len(doc['skipped'])}): {_first_few(doc['skipped'])}")
    if doc["dropped"]:
        lines.append(f"dropped by --rename ({len(doc['dropped'])}): {_first_few(doc['dropped'])}")
    return "\n".join(lines)


# Names listed in a line of `export`'s report; the rest are counted (an optimizer state dropped by
# --rename is thousands of names: --json lists them all).
_SHOWN_NAMES = 5


def _first_few(names: list[str]) -> str:
    if len(names) <= _SHOWN_NAMES:
        return ", ".join(names)
    return f"{', '.join(names[:_SHOWN_NAMES])} and {len(names) - _SHOWN_NAMES} more (--json lists them all)"
