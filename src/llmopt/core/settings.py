"""How an engine runs a candidate: the settings that are part of the candidate.

Two candidates with the same engine and recipe differ only here (the candidate id says how:
`torch-fp32-compile`). Written into `candidate.json` as a flat JSON object holding only the
fields that are set, so a run directory reads the same as before these settings were typed.

>>> s = EngineSettings.from_dict({"threads": 2, "device": "cpu", "compile": True})
>>> s.threads, s.compile, s.to_dict()
(2, True, {'device': 'cpu', 'threads': 2, 'compile': True})
>>> EngineSettings.from_dict({"n_batch": 64}).options   # an engine's own knob, kept as given
{'n_batch': 64}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineSettings"]


@dataclass(frozen=True)
class EngineSettings:
    """The settings an engine loads a candidate with. None means "the engine's default".

    Args:
        device: "cpu" or "cuda".
        threads: CPU threads (None: all the process may use).
        compile: compile the decode step (native engine; None: its default for the device).
        max_batch: sequences decoded together by a runner.
        max_seq_len: longest sequence a runner holds (prompt and generated tokens).
        max_length: tokens per input an embedder keeps.
        sort_by_length: embedders batch inputs of similar length together.
        options: an engine's own settings (named as the engine documents them), passed as given.
    """

    device: str = "cpu"
    threads: int | None = None
    compile: bool | None = None
    max_batch: int | None = None
    max_seq_len: int | None = None
    max_length: int | None = None
    sort_by_length: bool | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | EngineSettings | None) -> EngineSettings:
        """From candidate.json's flat object; keys that are not fields go to `options`."""
        if isinstance(d, EngineSettings):
            return d
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)} - {"options"}
        known = {k: d.pop(k) for k in list(d) if k in names}
        options = {**d.pop("options", {}), **d} if isinstance(d.get("options"), dict) else d
        return cls(**known, options=options)

    def to_dict(self) -> dict[str, Any]:
        """The flat JSON object: every field that is set, then the engine's own options."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "options" and getattr(self, f.name) is not None
        }
        return {**out, **self.options}

    def with_changes(self, **changes: Any) -> EngineSettings:
        """A copy with `changes` applied; names that are not fields become options."""
        return EngineSettings.from_dict({**self.to_dict(), **changes})
