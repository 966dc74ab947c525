"""Run a training script as `python SCRIPT ARGS...` would, and record when each optimizer step ends.

    TIMED_JSON=steps.json python benchmarks/_timed.py train_lora.py --train_batch_size 4 ...

The same measurement for our scripts and the Diffusers examples, without relying on anything they
log: a global optimizer step post-hook (torch.optim.optimizer.register_optimizer_step_post_hook)
fires after every `step()` of any torch.optim.Optimizer subclass. torch wraps a class's `step` in
`Optimizer.__init__`, so it covers torch.optim.AdamW and bitsandbytes' AdamW8bit (its
Optimizer8bit base calls `torch.optim.Optimizer.__init__`), but not accelerate's
AcceleratedOptimizer, which never calls that `__init__`: one timestamp per real step, not two.
A step that a gradient scaler skips (fp16 overflow) is not timed, as it does not train.

When the script ends (normally, by sys.exit, or with an error) the JSON file named by $TIMED_JSON
gets: "step_times" (time.perf_counter() after each step, after torch.cuda.synchronize() on a GPU
so the step's kernels are done), "max_memory_allocated" (bytes, torch.cuda.max_memory_allocated();
null without CUDA), "device" (the GPU's name, or "cpu"), "error" (null, or the exception) and
"start" (time.perf_counter() when this wrapper began: the first step's end minus it is the time to
the first step, imports, loading and any compilation included).

With TIMED_COUNT_OPS=1 it also counts every aten operation dispatched (a TorchDispatchMode over the
whole run, the backward's operations included) and writes "step_ops": for each optimizer step, a
{operation: count} of those dispatched since the end of the step before (the first: since the
start). Counting slows every operation: time nothing in such a run.
"""

import json
import os
import runpy
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

step_times, step_ops = [], []
ops = {}  # the operations dispatched since the last step ended
# The runtime calls that start work on a GPU: one kernel each, or a whole CUDA graph.
LAUNCHES = ("LaunchKernel", "GraphLaunch")
PROFILE_STEP = int(os.environ.get("TIMED_PROFILE", "0"))  # 0: no profile
profiler = None


class CountOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        ops[name] = ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def record_step(optimizer, args, kwargs):
    if torch.cuda.is_initialized():  # kernels run asynchronously: wait for this step's to end
        torch.cuda.synchronize()
    step_times.append(time.perf_counter())
    step_ops.append(dict(ops))
    ops.clear()
    global profiler
    if len(step_times) == PROFILE_STEP - 1:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
        profiler.start()
    elif len(step_times) == PROFILE_STEP and profiler:
        profiler.stop()


def profile_summary(cuda):
    """The recorded step's kernels (a CPU: aten operations), their time and the host's launches."""
    events = profiler.key_averages()
    if cuda:
        copies = ("Memcpy", "Memset")
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        kernels = [e for e in kernels if not e.key.startswith(copies)]
        calls = [e for e in events if e.device_type == DeviceType.CPU]
        launches = sum(e.count for e in calls if any(k in e.key for k in LAUNCHES))
        ms = [e.self_device_time_total / 1e3 for e in kernels]
    else:
        kernels = [e for e in events if e.key.startswith("aten::")]
        launches, ms = None, [e.self_cpu_time_total / 1e3 for e in kernels]
    top = sorted(zip(ms, kernels), key=lambda pair: -pair[0])[:10]
    return {
        "kernels": sum(e.count for e in kernels),
        "launches": launches,
        "busy_ms": sum(ms),
        "top": [[e.key, e.count, t] for t, e in top],
    }


def main():
    if len(sys.argv) < 2:
        raise SystemExit("usage: TIMED_JSON=out.json python benchmarks/_timed.py SCRIPT [ARGS...]")
    start = time.perf_counter()
    out, script = os.environ["TIMED_JSON"], sys.argv[1]
    register_optimizer_step_post_hook(record_step)
    # As `python SCRIPT ARGS` sees it: its own argv, and its folder first on the import path.
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    error = None
    counter = CountOps() if os.environ.get("TIMED_COUNT_OPS") == "1" else None
    try:
        if counter:
            counter.__enter__()
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # sys.exit(0) or None is a normal end; anything else is an error
        if e.code not in (0, None):
            error = f"SystemExit: {e.code}"
        raise
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        if counter:
            counter.__exit__(None, None, None)
        cuda = torch.cuda.is_initialized()  # the script ran on the GPU
        result = {
            "step_times": step_times,
            "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "error": error,
            "start": start,
        }
        if counter:
            result["step_ops"] = step_ops
        if profiler and len(step_times) >= PROFILE_STEP:
            try:  # the steps' times stand without it
                result["profile"] = profile_summary(cuda)
            except Exception as e:  # noqa: BLE001  whatever the profiler's events lack
                print(f"_timed.py: no profile summary: {e!r}", file=sys.stderr)
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
