"""llmopt: turn a Hugging Face transformer folder into the fastest deployment that keeps its quality.

The public entry points are small functions that return result objects; the CLI renders them.

>>> from llmopt import inspect_model
>>> info = inspect_model("minilm-l6")          # doctest: +SKIP
>>> info.task, info.num_layers                  # doctest: +SKIP
('embedding', 6)
"""

from __future__ import annotations

import time as _time

__version__ = "0.1.0"

# When llmopt was first imported (epoch seconds): the start of a command's time budget. Not the
# process's creation time: `bash -c "setup && llmopt optimize"` execs llmopt in the process bash
# forked before the setup ran, and the setup's minutes would count against the search.
IMPORTED_AT = _time.time()

__all__ = ["__version__", "inspect_model", "optimize"]


def __getattr__(name: str):
    # Lazy re-exports: importing `llmopt` must stay instant (no torch) so `llmopt --help` is too.
    if name == "inspect_model":
        from llmopt.model.info import inspect_model

        return inspect_model
    if name == "optimize":
        from llmopt.optimize.job import optimize  # lazy: `import llmopt` stays light

        return optimize
    raise AttributeError(name)
