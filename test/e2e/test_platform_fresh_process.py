"""The CPU platform in a fresh interpreter, as SGLang's spawned children are: only the .pth hook
applies, and SGLang imports and runs on a machine with no NVIDIA driver.
"""

from __future__ import annotations

import os
import subprocess
import sys

from support.platform_marks import needs_no_driver


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter, as SGLang's spawned children are: only the .pth hook applies."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


@needs_no_driver
def test_fresh_process_gets_cpu_engine_and_kernel_stand_ins() -> None:
    run = run_python(
        "import os, sgl_kernel\n"
        "from sglang.srt.utils.common import is_cpu\n"
        "from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_func\n"
        "import torch\n"
        "print(is_cpu(), os.environ['SGLANG_HOST_IP'], "
        "hasattr(torch.ops.sgl_kernel, 'assign_req_to_token_pool_cpu'))\n"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "127.0.0.1", "True"]


@needs_no_driver
def test_hicache_host_pools_keep_a_cpu_sized_reserve() -> None:
    # SGLang keeps 10 GiB of RAM free beside HiCache host pools, so a store-attached instance
    # would not start on a machine with less free; on the CPU the reserve is 1 GiB.
    run = run_python(
        "from sglang.srt.mem_cache.pool_host import base\n"
        "print(base.HICACHE_HOST_MEMORY_RESERVE_BYTES)\n"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) == 1 << 30


@needs_no_driver
def test_torch_native_attention_scratch_is_zeroed() -> None:
    # Its extend path ran attention over uninitialised query rows; denormals there made CPU
    # attention ~90x slower. Zeroed scratch keeps the kept rows bit for bit.
    run = run_python(
        "import torch\n"
        "from sglang.srt.layers.attention import torch_native_backend as b\n"
        "x = torch.full((4096,), 1e-40)\n"
        "del x\n"
        "print(bool(b.torch.empty(4096).eq(0).all()), bool(b.torch.empty_like(\n"
        "    torch.ones(7)).eq(0).all()), b.torch.float32 is torch.float32)\n"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-3:] == ["True", "True", "True"]


@needs_no_driver
def test_user_environment_wins() -> None:
    run = run_python(
        "import sglang, os; print(os.environ['SGLANG_HOST_IP'])", SGLANG_HOST_IP="127.0.0.2"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "127.0.0.2"


def test_hook_does_nothing_where_cuda_is_usable() -> None:
    # BANASERVE_PLATFORM=cuda makes the hook behave as on a GPU machine: sglang and
    # sgl_kernel load untouched, so on this driverless machine sgl_kernel fails as it
    # does without BanaServe, and no CPU variables are set.
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE",)}
    env["BANASERVE_PLATFORM"] = "cuda"
    run = subprocess.run(
        [sys.executable, "-c",
         "import os, sglang\n"
         "print(os.environ.get('SGLANG_USE_CPU_ENGINE'))\n"
         "try:\n import sgl_kernel\nexcept ImportError:\n print('ImportError')\n"
         "else:\n print('loaded', getattr(sgl_kernel, '__banaserve_fallback__', None))\n"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split()
    assert lines[0] == "None"
    assert lines[1] in ("ImportError", "loaded") and "fallback" not in run.stdout
