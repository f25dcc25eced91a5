"""The built-in GPU check, run as its own process (CUDA never enters the supervisor or the zygote):
each visible GPU answers a small allocation and copy, and, where nvidia-ml-py is installed, has
no pending retired pages or row remaps and no uncorrectable ECC errors. One JSON line per GPU on
stdout, after MARK: {"name": "gpu 0", "status": "passed"|"failed"|"unknown", "detail": "..."}
(and "gpu 0 memory" for NVML's answers)."""

import json
import sys
from typing import Any, List, Tuple

__all__ = ["GPU_PROBE_MODULE", "MARK"]

GPU_PROBE_MODULE = "launcher.forked.gpu_probe"
MARK = "ftlaunch-gpu-check "
_ELEMENTS = 1 << 20  # 4 MB of float32: enough to touch the memory, quick on any GPU


def _answers(torch: Any, index: int) -> str:
    """'' when the GPU allocates, computes and copies back what it was given; else why not."""
    device = torch.device("cuda", index)
    data = torch.arange(_ELEMENTS, dtype=torch.float32)
    on_gpu = data.to(device) * 2
    back = on_gpu.cpu()
    torch.cuda.synchronize(device)
    if not torch.equal(back, data * 2):
        return "the copy back differs from what was sent"
    return ""


def _nvml_problems(pynvml: Any, uuid: str) -> Tuple[str, str]:
    """(status, detail) from NVML for the GPU of ``uuid``: pending retired pages or row remaps,
    uncorrectable ECC errors since the driver loaded. A query the GPU does not support is skipped."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except pynvml.NVMLError as err:
        return "unknown", f"NVML does not know {uuid}: {err}"
    problems: List[str] = []
    asked = 0
    try:
        if pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
            problems.append("retired pages pending (reset the GPU)")
        asked += 1
    except pynvml.NVMLError:
        pass
    try:
        _corr, _unc, pending, failed = pynvml.nvmlDeviceGetRemappedRows(handle)
        if pending or failed:
            problems.append("row remapping " + ("failed" if failed else "pending (reset the GPU)"))
        asked += 1
    except pynvml.NVMLError:
        pass
    try:
        errors = pynvml.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
        )
        if errors:
            problems.append(f"{errors} uncorrectable ECC error(s) since the driver loaded")
        asked += 1
    except pynvml.NVMLError:
        pass
    if problems:
        return "failed", "; ".join(problems)
    return (
        ("passed", "NVML: no pending retirement, no uncorrectable ECC")
        if asked
        else (
            "unknown",
            "NVML answers none of the memory queries",
        )
    )


def _say(name: str, status: str, detail: str) -> None:
    print(MARK + json.dumps({"name": name, "status": status, "detail": detail}), flush=True)


def _nvml() -> Tuple[Any, str]:
    """pynvml initialised, or None and why not (not installed, no driver library)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, ""
    except Exception as err:  # noqa: BLE001 - any failure here means: not known
        return None, f"NVML not asked ({type(err).__name__}; pip install 'ftlaunch[nvml]')"


def main() -> int:
    """Exit 1 when a GPU failed; every GPU's lines are said either way."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        _say("gpus", "unknown", "no GPU visible to the check's process")
        return 0
    pynvml, why_not = _nvml()
    failed = False
    for index in range(count):
        try:
            wrong = _answers(torch, index)
        except Exception as err:  # noqa: BLE001 - a CUDA error is this GPU's answer
            wrong = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        _say(f"gpu {index}", "failed" if wrong else "passed", wrong or "a small allocation and copy")
        failed = failed or bool(wrong)
        if pynvml is None:
            _say(f"gpu {index} memory", "unknown", why_not)
            continue
        uuid = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
        status, detail = _nvml_problems(pynvml, uuid)
        _say(f"gpu {index} memory", status, detail)
        failed = failed or status == "failed"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
