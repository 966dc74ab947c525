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
null without CUDA), "device" (the GPU's name, or "cpu"), "error" (null, or the exception) and "start"
(time.perf_counter() when this wrapper began: the first step's end minus it is the time to the
first step, imports, loading and any compilation included).

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
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

step_times, step_ops = [], []
ops = {}  # the operations dispatched since the last step ended


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
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
