"""Checks of the GPU stack: driver, each GPU, CUDA runtime vs driver, device selection, compat.

When no driver answers, `likely_causes` reads the traces below NVML (PCI ids, kernel modules,
device nodes, Secure Boot, container) and lists the causes that fit, each with the commands that
confirm it and the fix. Whether "no GPU" is a failure depends on the target:

| target | no NVIDIA GPU/driver |
| --- | --- |
| cpu  | ok (not needed) |
| auto | warn (CPU-only: GPU engines unavailable) |
| cuda | fail |
"""

from __future__ import annotations

from typing import Any

from llmopt.doctor.report import Finding, Status
from llmopt.hardware.specs import (
    ENGINE_MIN_CC,
    cc_tuple,
    cuda_driver_minimum,
    dtype_support,
    version_at_least,
)

__all__ = ["gpu_findings", "likely_causes", "select_gpus", "NO_GPU_STATUS"]

GiB = 2**30
NO_GPU_STATUS: dict[str, Status] = {"cpu": "ok", "auto": "warn", "cuda": "fail"}
# Engine rule name -> the distribution whose version the rule is about.
_RULE_PACKAGE = {"vllm": "vllm", "tensorrt": "tensorrt", "flash-attn": "flash-attn"}


def select_gpus(facts: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The GPU list from the best source that answered: NVML, nvidia-smi, then torch."""
    for key in ("nvml", "nvidia_smi"):
        src = facts.get(key) or {}
        if src.get("ok") and src.get("devices"):
            gpus = [dict(d) for d in src["devices"]]
            by_uuid = {d.get("uuid"): d for d in (facts.get("torch") or {}).get("devices", [])}
            for g in gpus:  # fill what the first source could not tell from torch
                t = by_uuid.get(g.get("uuid"))
                if t and not g.get("compute_capability"):
                    g["compute_capability"] = t["compute_capability"]
            return gpus, key
    t = facts.get("torch") or {}
    if t.get("devices"):
        return [dict(d, source="torch") for d in t["devices"]], "torch"
    return [], None


def _cause(cause: str, evidence: str, confirm: list[str], fix: str) -> dict[str, Any]:
    return {"cause": cause, "evidence": evidence, "confirm": confirm, "fix": fix}


def likely_causes(facts: dict[str, Any]) -> list[dict[str, Any]]:
    """Why no NVIDIA driver answered, most likely first, each with confirming commands."""
    tr, cont = facts["driver_traces"], facts["container"]
    nvml_err = (facts.get("nvml") or {}).get("error") or ""
    pci, mods, nodes = tr["pci_nvidia"], tr["modules"], tr["dev_nodes"]
    out = []
    if "mismatch" in nvml_err.lower():
        out.append(
            _cause(
                "driver/library version mismatch: the driver was upgraded but the old kernel module is still loaded",
                f"NVML said: {nvml_err}",
                ["cat /proc/driver/nvidia/version", "nvidia-smi"],
                "reboot (or unload and reload the nvidia kernel modules)",
            )
        )
    if tr["pci_readable"] and not pci:
        where = (
            " (this is a container or VM: the host may have a GPU that is not passed through)"
            if cont["inside"]
            else ""
        )
        out.append(
            _cause(
                f"no NVIDIA GPU in this machine{where}",
                "no PCI device has NVIDIA's vendor id 0x10de in /sys/bus/pci/devices; "
                f"/dev/nvidia* nodes: {', '.join(nodes) or 'none'}; "
                f"/proc/driver/nvidia/version {'present' if tr['proc_driver_version'] else 'absent'}",
                [
                    "lspci -nn | grep -i nvidia",
                    "grep -l 0x10de /sys/bus/pci/devices/*/vendor",
                    "ls -l /dev/nvidia*",
                ],
                "run on a machine (or cloud instance type) with an NVIDIA GPU, or plan for the CPU with --target cpu",
            )
        )
        return out
    if pci and cont["inside"] and not nodes:
        out.append(
            _cause(
                "container started without GPU access",
                f"{len(pci)} NVIDIA PCI device(s) visible but no /dev/nvidia* nodes inside the container",
                [
                    "ls -l /dev/nvidia*",
                    "docker info | grep -i runtime   # on the host",
                    "nvidia-smi   # on the host",
                ],
                "start it with `docker run --gpus all` (NVIDIA Container Toolkit on the host) or, on "
                "Kubernetes, request nvidia.com/gpu with the NVIDIA device plugin",
            )
        )
    if mods and mods.get("nouveau"):
        out.append(
            _cause(
                "the open-source nouveau driver owns the GPU (CUDA needs NVIDIA's driver)",
                "kernel module nouveau is loaded",
                ["lsmod | grep -E 'nouveau|nvidia'", "lspci -k -d 10de:"],
                "blacklist nouveau (echo 'blacklist nouveau' | sudo tee /etc/modprobe.d/blacklist-nouveau.conf; "
                "sudo update-initramfs -u), install the NVIDIA driver, reboot",
            )
        )
    if pci and (mods is None or not mods.get("nvidia")):
        state = "not loaded" if mods is not None else "state unknown (no /proc/modules)"
        if tr["secure_boot"]:
            out.append(
                _cause(
                    "Secure Boot blocks the unsigned nvidia kernel module",
                    f"Secure Boot is enabled; nvidia module {state}",
                    [
                        "mokutil --sb-state",
                        "sudo dmesg | grep -i -E 'nvidia|module verification|lockdown'",
                    ],
                    "enrol the module's signing key with MOK (distribution driver packages do this), or "
                    "install a signed driver package, or disable Secure Boot",
                )
            )
        out.append(
            _cause(
                "NVIDIA driver not installed, or its module not loaded (e.g. after a kernel update without DKMS rebuild)",
                f"{len(pci)} NVIDIA PCI device(s) ({', '.join(p['slot'] for p in pci)}); nvidia module {state}; "
                f"bound driver: {', '.join(str(p['driver']) for p in pci)}",
                [
                    "lsmod | grep nvidia",
                    "modinfo nvidia",
                    "dkms status",
                    "sudo modprobe nvidia && nvidia-smi",
                    "sudo dmesg | grep -i nvidia",
                ],
                "install the driver (Ubuntu: sudo ubuntu-drivers install; others: the distribution's "
                "nvidia-driver package) and reboot",
            )
        )
    if pci and mods and mods.get("nvidia") and not tr["nvml_library"]:
        out.append(
            _cause(
                "the driver's user-space library libnvidia-ml.so is missing",
                "nvidia module loaded, but no libnvidia-ml.so on the library path",
                ["ldconfig -p | grep nvidia-ml", "nvidia-smi"],
                "install the driver's utils/compute package matching the kernel module version, or in a "
                "container set NVIDIA_DRIVER_CAPABILITIES=compute,utility",
            )
        )
    if not out:
        out.append(
            _cause(
                "the driver could not be reached for a reason the traces do not show",
                f"NVML: {nvml_err or 'n/a'}; nvidia-smi: {(facts.get('nvidia_smi') or {}).get('error')}",
                ["nvidia-smi", "sudo dmesg | grep -i nvidia", "ls -l /dev/nvidia*"],
                "run nvidia-smi and fix what it reports",
            )
        )
    return out


def _driver(
    facts: dict[str, Any], gpus: list[dict[str, Any]], source: str | None, target: str
) -> Finding:
    nvml, smi, t = facts.get("nvml") or {}, facts.get("nvidia_smi") or {}, facts.get("torch") or {}
    if gpus:
        dv = nvml.get("driver_version") or smi.get("driver_version")
        cuda = nvml.get("cuda_driver_version") or smi.get("cuda_driver_version")
        ev = f"NVIDIA driver {dv or 'version unknown'} (supports CUDA up to {cuda or '?'}); {len(gpus)} GPU(s), read through {source}"
        return Finding(
            "gpu.driver",
            "NVIDIA driver",
            "ok",
            ev,
            None,
            {"driver_version": dv, "cuda_driver_version": cuda},
        )
    torch_ev = (
        f"torch {t['version']} (CUDA build: {t.get('cuda') or 'none, CPU-only'}) sees no CUDA device"
        if t
        else "torch not installed"
    )
    ev = (
        f"no NVIDIA GPU/driver: NVML: {nvml.get('error') or 'not tried'}; nvidia-smi: "
        f"{smi.get('error') or 'not tried'}; {torch_ev}"
    )
    causes = likely_causes(facts)
    status = NO_GPU_STATUS[target]
    fix = None if status == "ok" else f"{causes[0]['fix']} (confirm: {causes[0]['confirm'][0]})"
    return Finding("gpu.driver", "NVIDIA driver", status, ev, fix, {"likely_causes": causes})


def _gpu(g: dict[str, Any]) -> Finding:
    total, used = g.get("memory_total_bytes") or 0, g.get("memory_used_bytes") or 0
    parts = [
        f"{g.get('name')}",
        f"compute capability {g.get('compute_capability') or '?'}",
        f"{total / GiB:.1f} GiB ({used / GiB:.1f} GiB in use)",
        f"MIG {g.get('mig_mode') or 'n/a'}",
        f"ECC {g.get('ecc_mode') or 'n/a'}",
    ]
    vol, agg = g.get("ecc_uncorrected_volatile"), g.get("ecc_uncorrected_aggregate")
    if vol is not None:
        parts.append(f"uncorrected ECC errors {vol} since boot, {agg} lifetime")
    ev, fid = ", ".join(parts), f"gpu.{g.get('index')}"
    title = f"GPU {g.get('index')}"
    if vol:
        return Finding(
            fid,
            title,
            "fail",
            ev,
            "uncorrected memory errors since boot: drain this GPU, "
            "reset it (nvidia-smi -r -i N) and replace it if they return",
        )
    if g.get("mig_mode") == "enabled":
        return Finding(
            fid,
            title,
            "warn",
            ev,
            "MIG is on: a process sees one MIG slice, not the whole "
            "GPU; put the MIG UUID (nvidia-smi -L) in CUDA_VISIBLE_DEVICES, or disable MIG "
            "(nvidia-smi -mig 0) to serve one large model",
        )
    if total and used > 0.1 * total:
        return Finding(
            fid,
            title,
            "warn",
            ev,
            "other processes hold GPU memory (nvidia-smi lists them); "
            "stop them or lower --gpu-memory-utilization",
        )
    if agg:
        return Finding(
            fid, title, "warn", ev, "uncorrected ECC errors in this GPU's past: watch it"
        )
    return Finding(fid, title, "ok", ev)


def _dtypes(gpus: list[dict[str, Any]]) -> Finding | None:
    rows = []
    for name, cc in sorted(
        {(g.get("name"), g.get("compute_capability")) for g in gpus if g.get("compute_capability")}
    ):
        sup = dtype_support(cc)
        rows.append(
            f"{name} (cc {cc}): bf16 {'yes' if sup['bfloat16'] else 'no (needs 8.0)'}, "
            f"fp8 {'yes' if sup['fp8'] else 'no (needs 8.9)'}, "
            f"fp4 {'yes' if sup['fp4'] else 'no (needs 10.0)'}, int8 {'yes' if sup['int8'] else 'no'}"
        )
    return Finding("gpu.dtypes", "precisions", "ok", "; ".join(rows)) if rows else None


def _runtime(
    facts: dict[str, Any], gpus: list[dict[str, Any]], drv: dict[str, Any]
) -> list[Finding]:
    t = facts.get("torch")
    if not t:
        return [
            Finding(
                "cuda.runtime",
                "CUDA runtime",
                "warn",
                "torch is not installed",
                "pip install torch (a CUDA build matching the driver)",
            )
        ]
    if not t.get("cuda"):
        return [
            Finding(
                "cuda.runtime",
                "CUDA runtime",
                "fail",
                f"torch {t['version']} is a CPU-only build; the GPU(s) above are unused",
                "install a CUDA build of torch, e.g. pip install torch --index-url "
                "https://download.pytorch.org/whl/cu128 (pick the CUDA version your driver supports)",
            )
        ]
    out = []
    dv, runtime = drv.get("driver_version"), t["cuda"]
    need = cuda_driver_minimum(runtime)
    ev = (
        f"torch {t['version']} built with CUDA {runtime}; driver {dv or '?'} supports CUDA up to "
        f"{drv.get('cuda_driver_version') or '?'}; CUDA {runtime.split('.')[0]}.x needs driver >= {need}"
    )
    if t.get("error"):
        out.append(
            Finding(
                "cuda.runtime",
                "CUDA runtime",
                "fail",
                f"{ev}; torch: {t['error']}",
                f"upgrade the driver to >= {need}, or install a torch build for an older CUDA",
            )
        )
    elif dv and need and not version_at_least(dv, need):
        out.append(
            Finding(
                "cuda.runtime",
                "CUDA runtime",
                "fail",
                ev,
                f"upgrade the driver to >= {need}, or install torch built for the CUDA "
                f"version the driver supports ({drv.get('cuda_driver_version')})",
            )
        )
    else:
        out.append(
            Finding(
                "cuda.runtime",
                "CUDA runtime",
                "ok",
                ev + f"; torch sees {t['device_count']} device(s)",
            )
        )
    arch = t.get("arch_list") or []
    for cc in sorted({g["compute_capability"] for g in gpus if g.get("compute_capability")}):
        sm = cc.replace(".", "")
        ptx_ok = any(a.startswith("compute_") and int(a[8:].rstrip("af")) <= int(sm) for a in arch)
        if arch and f"sm_{sm}" not in arch and not ptx_ok:
            out.append(
                Finding(
                    "cuda.arch",
                    "torch GPU code",
                    "fail",
                    f"torch ships code for {', '.join(arch)}, not for sm_{sm} (compute capability {cc})",
                    "install a torch build that supports this GPU (a newer CUDA build for new GPUs, "
                    "an older one for old GPUs)",
                )
            )
    return out


def _build_tools(facts: dict[str, Any]) -> Finding | None:
    """Can the native engine build its CUDA C++ GEMV here (nvcc matching torch's CUDA, ninja)?
    Without it int8/FP8 decode runs Triton's GEMV, slower (docs/native-engine.md)."""
    tools, t = facts.get("build_tools"), facts.get("torch") or {}
    if tools is None or not t.get("cuda"):  # (recorded before this check, or no CUDA torch)
        return None
    fix = (
        f"install the CUDA toolkit {t['cuda']} (its nvcc on PATH or CUDA_HOME set) and ninja "
        "(pip install ninja); the kernel builds once, on first use"
    )
    missing = [name for name in ("nvcc", "ninja") if not tools.get(name)]
    if missing:
        return Finding(
            "native.cuda_build",
            "native CUDA kernels",
            "warn",
            f"{' and '.join(missing)} not found: the native engine's int8/FP8 one-row GEMV "
            "falls back to Triton's (slower decode)",
            fix,
        )
    nv = tools.get("nvcc_version")
    if nv and nv.split(".")[0] != str(t["cuda"]).split(".")[0]:
        return Finding(
            "native.cuda_build",
            "native CUDA kernels",
            "warn",
            f"nvcc {nv} and torch's CUDA {t['cuda']} differ in major version: PyTorch refuses "
            "to build extensions then, and int8/FP8 decode falls back to Triton's GEMV",
            fix,
        )
    return Finding(
        "native.cuda_build",
        "native CUDA kernels",
        "ok",
        f"nvcc {nv or '?'} ({tools['nvcc']}) and ninja: the native engine's CUDA GEMV can be built",
    )


def _device(
    facts: dict[str, Any], gpus: list[dict[str, Any]], target: str
) -> tuple[Finding, dict[str, Any] | None]:
    env, t = facts.get("env") or {}, facts.get("torch") or {}
    cvd, order = env.get("CUDA_VISIBLE_DEVICES"), env.get("CUDA_DEVICE_ORDER")
    setting = f"CUDA_VISIBLE_DEVICES={'unset' if cvd is None else repr(cvd)}, CUDA_DEVICE_ORDER={order or 'unset (FASTEST_FIRST)'}"
    hetero = len({g.get("name") for g in gpus}) > 1
    fix = None
    if hetero and order != "PCI_BUS_ID":
        fix = (
            "GPUs differ and CUDA numbers them fastest first while nvidia-smi numbers them by PCI bus: "
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID so indices agree, then pick with CUDA_VISIBLE_DEVICES"
        )
    if t.get("devices"):
        d0 = t["devices"][0]
        match = next((g for g in gpus if g.get("uuid") and g.get("uuid") == d0.get("uuid")), None)
        where = f" = NVML index {match['index']}, PCI {match.get('pci_bus_id')}" if match else ""
        dev = {
            "cuda:0": d0.get("name"),
            "uuid": d0.get("uuid"),
            "nvml_index": match and match["index"],
            "visible": t.get("device_count"),
            "source": "torch",
        }
        ev = f"cuda:0 is {d0['name']}{where}; {t['device_count']} device(s) visible; {setting}"
        return Finding("cuda.device", "device used", "warn" if fix else "ok", ev, fix), dev
    if cvd is not None and cvd.strip() in ("", "-1", "none", "NoDevFiles"):
        return Finding(
            "cuda.device",
            "device used",
            "fail" if target == "cuda" else "warn",
            f"{setting}: no device is visible to CUDA programs",
            "unset CUDA_VISIBLE_DEVICES or list the GPUs to use (indices or UUIDs from nvidia-smi -L)",
        ), None
    picked = gpus[0]
    if cvd:
        first = cvd.split(",")[0].strip()
        picked = next(
            (
                g
                for g in gpus
                if str(g.get("index")) == first or (g.get("uuid") or "").startswith(first)
            ),
            None,
        )
        if picked is None:
            return Finding(
                "cuda.device",
                "device used",
                "fail" if target == "cuda" else "warn",
                f"{setting}: its first entry {first!r} names no GPU found",
                "use indices or UUIDs from nvidia-smi -L",
            ), None
    dev = {
        "cuda:0": picked.get("name"),
        "uuid": picked.get("uuid"),
        "nvml_index": picked.get("index"),
        "source": "CUDA_VISIBLE_DEVICES over the NVML list (torch could not confirm)",
    }
    ev = f"cuda:0 would be {picked.get('name')} (NVML index {picked.get('index')}); {setting}"
    return Finding("cuda.device", "device used", "warn" if fix else "ok", ev, fix), dev


def _compat(
    facts: dict[str, Any], gpus: list[dict[str, Any]]
) -> tuple[list[Finding], list[dict[str, Any]]]:
    pk = facts.get("packages") or {}
    torch_cuda = (facts.get("torch") or {}).get("cuda")
    table, out = [], []
    for name, cc in sorted(
        {(g.get("name"), g.get("compute_capability")) for g in gpus if g.get("compute_capability")}
    ):
        cct, engines = cc_tuple(cc), {}
        for engine, since, need, why in ENGINE_MIN_CC:
            ok = cct >= need
            label = f"{engine} >= {since}" if since != "0" else engine
            engines[label] = "ok" if ok else f"needs cc >= {need[0]}.{need[1]}"
            installed = (
                torch_cuda if engine == "torch-cuda" else pk.get(_RULE_PACKAGE.get(engine, ""))
            )
            if not ok and installed and version_at_least(installed, since):
                out.append(
                    Finding(
                        f"compat.{engine}",
                        f"{engine} vs GPU",
                        "fail",
                        f"{engine} {installed} is installed; {name} has compute capability {cc}: {why}",
                        f"use a {engine} release before {since} for this GPU, or a newer GPU",
                    )
                )
        table.append(
            {"gpu": name, "compute_capability": cc, "dtypes": dtype_support(cc), "engines": engines}
        )
    return out, table


def gpu_findings(
    facts: dict[str, Any], target: str
) -> tuple[list[Finding], list[dict[str, Any]], dict[str, Any] | None, list[dict[str, Any]]]:
    """(findings, GPUs, device used as cuda:0, compat table) for the GPU stack.

    Args:
        facts: from `collect_facts` or a recorded fixture.
        target: "auto", "cpu" or "cuda" (decides how absence of a GPU is judged).
    """
    gpus, source = select_gpus(facts)
    driver = _driver(facts, gpus, source, target)
    findings = [driver]
    if not gpus:
        return findings, [], None, []
    findings += [_gpu(g) for g in gpus]
    dt = _dtypes(gpus)
    findings += [dt] if dt else []
    findings += _runtime(facts, gpus, driver.details)
    build = _build_tools(facts)
    findings += [build] if build else []
    dev_finding, device = _device(facts, gpus, target)
    compat_findings, table = _compat(facts, gpus)
    return findings + [dev_finding] + compat_findings, gpus, device, table
