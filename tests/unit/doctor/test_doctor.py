"""`llmopt doctor`: live on this machine (no GPU), and replayed from answers recorded on an H200.

Fixtures in tests/fixtures/doctor/ named `recorded_*` came from real machines (the H200 lent to
this project, 2026-11-29; this CPU VM); scenarios the project has no machine for (nouveau, Secure
Boot, old drivers, MIG, ECC errors, mixed GPUs) are *synthetic*: built below by editing a
recorded fixture, so every field a check reads is realistic.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmopt.doctor import collect_facts, diagnose, run_doctor
from llmopt.hardware.gpu import (
    DEVICE_CALLS,
    interpret_nvml,
    parse_nvidia_smi,
    probe_nvml,
    record_nvml,
)
from llmopt.hardware.specs import cuda_driver_minimum, dtype_support, lookup_gpu, match_gpu

FIX = Path(__file__).parents[2] / "fixtures" / "doctor"
H200_FACTS = json.loads((FIX / "recorded_h200_facts.json").read_text())
CPU_FACTS = json.loads((FIX / "recorded_cpu_vm_facts.json").read_text())
H200_NVML = json.loads((FIX / "recorded_h200_nvml_answers.json").read_text())


class FakeNVML:
    """Replays recorded NVML answers through the pynvml API doctor calls."""

    class NVMLError(Exception):
        pass

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 1, 0, 1
    NVML_TEMPERATURE_GPU = 0
    __name__ = "pynvml"

    def __init__(self, answers):
        self.a = answers
        for key, fn in {
            "driver_version": "nvmlSystemGetDriverVersion",
            "cuda_driver_version": "nvmlSystemGetCudaDriverVersion",
            "nvml_version": "nvmlSystemGetNVMLVersion",
            "count": "nvmlDeviceGetCount",
        }.items():
            setattr(self, fn, lambda key=key: self._answer(self.a["system"][key]))
        for fn in {fn for fn, _ in DEVICE_CALLS.values()}:
            setattr(self, fn, lambda h, *args, fn=fn: self._device(fn, h, args))

    def _answer(self, ans):
        if "error" in ans:
            raise self.NVMLError(ans["error"])
        return ans["value"]

    def _device(self, fn, h, args):
        consts = tuple(
            k
            for k, (f, c) in DEVICE_CALLS.items()
            if f == fn and tuple(getattr(self, n) for n in c) == args
        )
        assert consts, f"unexpected call {fn}{args}"
        return self._answer(self.a["devices"][h][consts[0]])

    def nvmlInit(self):
        if "init_error" in self.a:
            raise self.NVMLError(self.a["init_error"])

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i


def test_no_gpu_here_is_reported_cleanly_per_target():
    report = run_doctor("auto")
    if report.gpus:
        pytest.skip("this machine has a GPU")
    driver = report.get("gpu.driver")
    assert driver.status == "warn" and "no NVIDIA GPU/driver" in driver.evidence
    causes = driver.details["likely_causes"]
    assert causes and all(c["confirm"] and c["fix"] for c in causes)
    assert any("lspci" in cmd for cmd in causes[0]["confirm"])
    json.dumps(report.to_dict())  # all of it is JSON
    facts = report.facts
    assert diagnose(facts, "cpu").get("gpu.driver").status == "ok"
    assert diagnose(facts, "cpu").exit_code == 0
    cuda = diagnose(facts, "cuda")
    assert cuda.get("gpu.driver").status == "fail" and cuda.exit_code == 1


def test_cli_doctor_exit_codes_and_json():
    cmd = [sys.executable, "-m", "llmopt.cli.main", "doctor"]
    ok = subprocess.run(
        [*cmd, "--target", "cpu", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    report = json.loads(ok.stdout)
    assert report["target"] == "cpu" and {f["id"] for f in report["findings"]} >= {
        "host.cpu",
        "gpu.driver",
    }
    assert ok.returncode == (1 if report["status"] == "fail" else 0)
    if report["gpus"]:
        pytest.skip("this machine has a GPU")
    bad = subprocess.run(
        [*cmd, "--target", "cuda"], capture_output=True, text=True, timeout=120, check=False
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert (
        "Why no NVIDIA driver answered" in bad.stdout and "Traceback" not in bad.stdout + bad.stderr
    )


def test_recorded_h200_reports_card_driver_cc_and_fp8():
    r = diagnose(copy.deepcopy(H200_FACTS), "cuda")
    assert r.exit_code == 0 and r.worst == "ok", [(f.id, f.status, f.fix) for f in r.findings]
    g = r.gpus[0]
    assert (g["name"], g["compute_capability"], g["memory_total_bytes"]) == (
        "NVIDIA H200",
        "9.0",
        143771 * 2**20,
    )
    assert r.get("gpu.driver").details["driver_version"] == "580.159.04"
    assert "fp8 yes" in r.get("gpu.dtypes").evidence
    assert r.compat[0]["dtypes"]["fp8"] and not r.compat[0]["dtypes"]["fp4"]
    assert "CUDA 13.0" in r.get("cuda.runtime").evidence
    assert r.device["nvml_index"] == 0 and r.device["cuda:0"] == "NVIDIA H200"


def test_nvml_replay_matches_recording_and_interpretation():
    fake = FakeNVML(H200_NVML)
    assert record_nvml(fake) == H200_NVML, "replaying the recording records the same answers"
    facts, _ = probe_nvml(fake)
    assert facts["ok"] and facts["cuda_driver_version"] == "13.0"
    d = facts["devices"][0]
    assert (d["compute_capability"], d["mig_mode"], d["ecc_mode"], d["power_limit_w"]) == (
        "9.0",
        "disabled",
        "enabled",
        700.0,
    )
    smi = parse_nvidia_smi((FIX / "recorded_h200_nvidia_smi.csv").read_text())[0]
    for key in (
        "name",
        "uuid",
        "pci_bus_id",
        "compute_capability",
        "memory_total_bytes",
        "mig_mode",
        "ecc_mode",
    ):
        assert smi[key] == d[key], key


def test_nvml_failures_are_facts_not_crashes():
    facts, answers = probe_nvml(FakeNVML({"init_error": "Driver Not Loaded"}))
    assert not facts["ok"] and facts["error"] == "Driver Not Loaded"
    broken = copy.deepcopy(H200_NVML)
    broken["devices"][0]["mig_mode"] = {"error": "Not Supported"}
    assert interpret_nvml(record_nvml(FakeNVML(broken)))["devices"][0]["mig_mode"] is None
    row = parse_nvidia_smi(
        "0, Tesla T4, GPU-x, 0:1:0, 470.1, 15360, 5, [N/A], [N/A], Disabled, [N/A], 0, 40, 70.00"
    )[0]
    assert (
        row["compute_capability"] is None
        and row["mig_mode"] is None
        and row["ecc_uncorrected_volatile"] is None
    )


def _no_driver(pci: bool = True, **traces) -> dict:
    """Synthetic: this VM's recorded facts with an NVIDIA PCI device and other driver traces."""
    f = copy.deepcopy(CPU_FACTS)
    f["driver_traces"].update(
        {
            "pci_nvidia": [
                {"slot": "0000:01:00.0", "device_id": "0x2335", "class": "0x030200", "driver": None}
            ]
            if pci
            else [],
            "pci_readable": True,
            "modules": {
                "nvidia": False,
                "nvidia_uvm": False,
                "nvidia_drm": False,
                "nouveau": False,
            },
            "dev_nodes": [],
            "secure_boot": False,
        }
    )
    f["driver_traces"].update(traces)
    f["container"]["inside"] = False
    return f


@pytest.mark.parametrize(
    "facts, expect_cause, expect_cmd",
    [
        (_no_driver(modules={"nvidia": False, "nouveau": True}), "nouveau", "lsmod"),
        (_no_driver(secure_boot=True), "Secure Boot", "mokutil --sb-state"),
        (_no_driver(), "not installed", "dkms status"),
        (_no_driver(pci=False), "no NVIDIA GPU in this machine", "lspci -nn | grep -i nvidia"),
    ],
    ids=["nouveau", "secure-boot", "driver-not-loaded", "no-gpu"],
)
def test_likely_causes_synthetic(facts, expect_cause, expect_cmd):
    causes = diagnose(facts, "cuda").get("gpu.driver").details["likely_causes"]
    assert expect_cause in causes[0]["cause"], causes
    assert any(expect_cmd in c for cause in causes for c in cause["confirm"])


def test_container_without_gpu_and_version_mismatch_synthetic():
    f = _no_driver()
    f["container"]["inside"] = True
    assert (
        "container started without GPU access"
        in diagnose(f, "cuda").get("gpu.driver").details["likely_causes"][0]["cause"]
    )
    f = _no_driver(modules={"nvidia": True, "nouveau": False}, dev_nodes=["/dev/nvidia0"])
    f["nvml"] = {"ok": False, "error": "Driver/library version mismatch", "devices": []}
    causes = diagnose(f, "cuda").get("gpu.driver").details["likely_causes"]
    assert "mismatch" in causes[0]["cause"] and "reboot" in causes[0]["fix"]


def _h200(**edit) -> dict:
    f = copy.deepcopy(H200_FACTS)
    for path, value in edit.items():
        node = f
        *keys, last = path.split("__")
        for k in keys:
            node = node[int(k)] if isinstance(node, list) else node[k]
        node[last] = value
    return f


def test_gpu_stack_failures_synthetic():
    cpu_torch = diagnose(
        _h200(torch__cuda=None, torch__cuda_available=False, torch__devices=[]), "cuda"
    )
    assert (
        cpu_torch.get("cuda.runtime").status == "fail"
        and "CPU-only" in cpu_torch.get("cuda.runtime").evidence
    )
    old = diagnose(_h200(nvml__driver_version="520.61.05", torch__cuda="12.4"), "cuda")
    assert old.get("cuda.runtime").status == "fail" and "525.60.13" in old.get("cuda.runtime").fix
    ecc = diagnose(_h200(nvml__devices__0__ecc_uncorrected_volatile=3), "cuda")
    assert ecc.get("gpu.0").status == "fail" and ecc.exit_code == 1
    mig = diagnose(_h200(nvml__devices__0__mig_mode="enabled"), "cuda")
    assert (
        mig.get("gpu.0").status == "warn" and "MIG" in mig.get("gpu.0").fix and mig.exit_code == 0
    )
    noarch = diagnose(_h200(torch__arch_list=["sm_80", "sm_86"]), "cuda")
    assert noarch.get("cuda.arch").status == "fail"


def test_cuda_build_tools_synthetic():
    """The native engine's CUDA GEMV needs nvcc (the major version of torch's CUDA) and ninja:
    each missing piece is a warning that says what falls back and how to fix it; a recording
    made before the check has no finding."""
    assert diagnose(_h200(), "cuda").get("native.cuda_build") is None  # (recorded before)
    cuda = H200_FACTS["torch"]["cuda"]
    nvcc = {"nvcc": "/usr/local/cuda/bin/nvcc", "nvcc_version": cuda, "ninja": "/usr/bin/ninja"}
    ok = diagnose({**_h200(), "build_tools": nvcc}, "cuda").get("native.cuda_build")
    assert ok.status == "ok" and cuda in ok.evidence
    for edit, words in (
        ({"nvcc": None, "nvcc_version": None}, "nvcc not found"),
        ({"ninja": None}, "ninja not found"),
        ({"nvcc_version": "11.8"}, "major version"),
    ):
        f = diagnose({**_h200(), "build_tools": {**nvcc, **edit}}, "cuda").get("native.cuda_build")
        assert f.status == "warn" and words in f.evidence and "ninja" in f.fix, edit
    cpu_torch = _h200(torch__cuda=None, torch__cuda_available=False, torch__devices=[])
    assert diagnose({**cpu_torch, "build_tools": nvcc}, "cuda").get("native.cuda_build") is None


def test_device_selection_synthetic():
    f = _h200()
    l4 = dict(
        f["nvml"]["devices"][0], index=1, name="NVIDIA L4", uuid="GPU-l4", compute_capability="8.9"
    )
    f["nvml"]["devices"].append(l4)
    assert diagnose(f, "cuda").get("cuda.device").status == "warn"  # mixed GPUs, CUDA order unset
    f["env"]["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    assert diagnose(f, "cuda").get("cuda.device").status == "ok"
    f = _h200(torch__devices=[], torch__cuda_available=False, env__CUDA_VISIBLE_DEVICES="")
    assert diagnose(f, "cuda").get("cuda.device").status == "fail"
    f = _h200(torch__devices=[], env__CUDA_VISIBLE_DEVICES="GPU-b671192e")
    assert diagnose(f, "cuda").device["nvml_index"] == 0


def test_engine_generation_rules_synthetic():
    def v100(trt: str):
        f = _h200(
            nvml__devices__0__name="Tesla V100-SXM2-32GB",
            nvml__devices__0__compute_capability="7.0",
            torch__cuda="12.4",
            torch__arch_list=["sm_70", "sm_80", "sm_90"],
        )
        f["packages"]["tensorrt"] = trt
        return diagnose(f, "cuda")

    assert v100("10.5.0").get("compat.tensorrt").status == "fail"  # Volta removed in 10.5
    assert v100("10.4.0").get("compat.tensorrt") is None
    assert v100("10.4.0").compat[0]["engines"]["tensorrt >= 10.5"] == "needs cc >= 7.5"


def test_hardware_table_and_rules():
    assert match_gpu("NVIDIA L40S").name == "L40S" and match_gpu("NVIDIA L4").name == "L4"
    assert (
        match_gpu("NVIDIA A100-SXM4-40GB").name == "A100-40GB"
        and match_gpu("NVIDIA A10").name == "A10"
    )
    assert lookup_gpu("h200").memory_bytes == 143771 * 2**20
    assert dtype_support("8.0") == {
        "float32": True,
        "float16": True,
        "int8": True,
        "bfloat16": True,
        "fp8": False,
        "fp4": False,
    }
    assert dtype_support("10.0")["fp4"] and dtype_support("8.9")["fp8"]
    assert cuda_driver_minimum("12.8") == "525.60.13" and cuda_driver_minimum("13.0") == "580.65.06"
    from llmopt.hardware.specs import UnknownGpuError

    with pytest.raises(UnknownGpuError, match="H200"):
        lookup_gpu("GTX 480")


def test_collect_facts_is_json_and_has_every_section():
    facts = collect_facts(use_torch=False)
    assert set(facts) >= {
        "host",
        "cpu",
        "memory",
        "disk",
        "packages",
        "container",
        "driver_traces",
        "env",
        "nvml",
        "nvidia_smi",
        "torch",
        "build_tools",
    }
    assert set(facts["build_tools"]) == {"nvcc", "nvcc_version", "ninja"}
    json.dumps(facts)
