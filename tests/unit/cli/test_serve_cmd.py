"""`llmopt serve --engine`: which engines llmopt's own server drives."""

from __future__ import annotations

import pytest

from llmopt.cli.serve_cmd import _in_process


def test_engines_with_a_generator_are_served_in_process():
    assert _in_process("torch") and _in_process("hf") and _in_process("openvino")
    assert not _in_process("vllm") and not _in_process("llamacpp") and not _in_process(None)
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        _in_process("tgi")
