"""The one host probe: cores, memory, CPU name and ISA flags."""

from __future__ import annotations

from llmopt.hardware import host


def test_host_probe_is_public_and_consistent():
    assert host.usable_cores() >= 1 and host.ram_bytes() > 0 and host.cpu_name()
    assert set(host.isa_features()) <= set(host.ISA_FLAGS)
    cpu = host.probe_cpu()
    assert cpu["usable_cpus"] == host.usable_cores()
