"""Which frameworks touch CUDA when they are imported, as ftlaunch's fork server imports a script's
libraries before it forks the workers: each framework in a fresh interpreter, then whether torch
initialized CUDA (the fork server notices that and starts workers as new processes) and whether
the CUDA driver was initialized (``cuInit``, which ``torch.cuda.is_available()`` runs: torch does
not count it, and a process forked after it cannot use CUDA).

    python scripts/probe_cuda_imports.py

On a machine without the CUDA driver the driver column says "not loaded" for every row.
"""

import json
import subprocess
import sys

# What the examples import, adapters included (the Trainer's module in full: `from transformers
# import Trainer` imports it, where the fork server imports only the lazy `transformers`).
FRAMEWORKS = {
    "torch, worker_lib": ["torch", "torch.distributed", "worker_lib"],
    "Lightning": ["lightning.pytorch", "worker_lib.integrations.lightning"],
    "pytorch_lightning": ["pytorch_lightning"],
    "the Trainer": ["transformers", "transformers.trainer", "worker_lib.integrations.transformers"],
    "Accelerate": ["accelerate", "worker_lib.integrations.accelerate"],
}

_PROBE = """
import ctypes, importlib, json, sys, time
started = time.monotonic()
for name in sys.argv[1:]:
    importlib.import_module(name)
seconds = time.monotonic() - started
import torch
with open("/proc/self/maps") as maps:
    loaded = "libcuda.so" in maps.read()
driver = "not loaded"
if loaded:  # cuDeviceGetCount answers CUDA_ERROR_NOT_INITIALIZED (3) until cuInit, and starts nothing
    code = ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(ctypes.c_int()))
    driver = {0: "initialized", 3: "not initialized"}.get(code, f"error {code}")
print(json.dumps({"seconds": seconds, "torch": torch.cuda.is_initialized(), "driver": driver}))
"""


def probe(modules: list) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules], capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("torch", "lightning", "pytorch-lightning", "transformers", "accelerate"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} absent")
    return ", ".join(found)


def main() -> None:
    import torch

    print(f"{versions()}; CUDA {torch.version.cuda}, python {sys.version.split()[0]}")
    print("| imported | s | torch initialized CUDA | CUDA driver | the fork server can carry it |")
    print("|---|---|---|---|---|")
    for name, modules in FRAMEWORKS.items():
        found = probe(modules)
        if "error" in found:
            print(f"| {name} | - | - | - | not importable: {found['error']} |")
            continue
        carried = not found["torch"] and found["driver"] != "initialized"
        print(
            f"| {name} | {found['seconds']:.1f} | {'yes' if found['torch'] else 'no'} | "
            f"{found['driver']} | {'yes' if carried else 'no'} |"
        )


if __name__ == "__main__":
    main()
