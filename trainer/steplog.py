"""One line per logging step, the way nanoGPT's loop prints it, so a person watching
a run sees it learn:

    step 20/100 | loss 1.2345 | lr 1.20e-05 | grad 0.812 | 1,234 tok/s | MFU 31.2% | ETA 1m20s

Every figure comes from the steps that ran: loss, learning rate and gradient norm
from the trainer's own log record, tokens/s from the tokens it counted (padding
excluded) over the wall time between two logging steps, MFU (GPU only) from those
tokens/s against the device's peak. Tokens/s and MFU are added to the record, so
TensorBoard (a callback after this one) plots them beside the loss.

MFU has conventions; this one is said once, before step 1: model FLOPs per token
4N + 2N_trainable (attention left out, as NeMo and nanoGPT count), against the
vendor's dense bf16 datasheet peak (989 TFLOP/s for H100 and H200, the figure
public anchors divide by), not a measured matmul peak.
"""

from __future__ import annotations

import sys
import time

from transformers import ProgressCallback, TrainerCallback

#: Dense bf16 peak FLOP/s by device name (the vendor's datasheet figures, no sparsity).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def peak_flops(device_name: str) -> float | None:
    for key, flops in PEAK_FLOPS.items():
        if key in device_name:
            return flops
    return None


def flops_per_token(n_params: int, n_trainable: int) -> float:
    """Training FLOPs per token, from the parameter counts (attention left out, as
    nanoGPT's estimate does): forward 2N, backward 2N for the activations, and 2N
    more for weight gradients only where weights train (LoRA: the adapters alone)."""
    return 4 * n_params + 2 * n_trainable


def mfu_convention(device_name: str, n_params: int, n_trainable: int, peak: float) -> str:
    """The line that says what the step lines' MFU divides by what."""
    return (f"MFU: tokens/s x {flops_per_token(n_params, n_trainable) / 1e9:,.2f} GFLOP per token (4N + 2N_trainable, "
            f"N = {n_params / 1e9:.2f}B, attention not counted) over {device_name}'s {peak / 1e12:,.0f} TFLOP/s "
            "(dense bf16 datasheet peak)")


def eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class BarOnly(ProgressCallback):
    """transformers' progress bar without its printed log dicts: the step line says it, once."""

    def on_log(self, *args, **kwargs):
        pass


class StepLog(TrainerCallback):
    """Prints the line above at every logging step (world process zero only)."""

    def __init__(self, out=None, device_name: str = ""):
        self.out = out  # a file, or None: stderr through tqdm.write, so a progress bar stays intact
        self.device_name = device_name
        self.peak = peak_flops(device_name) if device_name else None
        self.convention = ""
        self.flops_per_token: float | None = None
        self._t0 = self._tokens0 = self._step0 = None
        self.lines: list[str] = []

    def on_train_begin(self, args, state, control, model=None, **kw):
        if model is not None:
            n = sum(p.numel() for p in model.parameters())
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            self.flops_per_token = flops_per_token(n, trainable)
            if self.peak:
                self.convention = mfu_convention(self.device_name, n, trainable, self.peak)
                self._print(self.convention, state)
        self._t0, self._tokens0, self._step0 = time.perf_counter(), int(state.num_input_tokens_seen or 0), state.global_step

    def on_log(self, args, state, control, logs=None, **kw):
        if logs is None or "loss" not in logs or self._t0 is None:
            return  # the end-of-training summary record, or an eval record
        now, tokens = time.perf_counter(), int(state.num_input_tokens_seen or 0)
        dt, dtok, dstep = now - self._t0, tokens - self._tokens0, state.global_step - self._step0
        self._t0, self._tokens0, self._step0 = now, tokens, state.global_step
        tps = dtok / dt if dt > 0 else 0.0
        logs["tokens_per_second"] = tps
        parts = [f"step {state.global_step}/{state.max_steps}", f"loss {logs['loss']:.4f}"]
        if "learning_rate" in logs:
            parts.append(f"lr {logs['learning_rate']:.2e}")
        if logs.get("grad_norm") is not None:
            parts.append(f"grad {float(logs['grad_norm']):.3f}")
        parts.append(f"{tps:,.0f} tok/s")
        if self.peak and self.flops_per_token:
            mfu = tps * self.flops_per_token / (self.peak * max(args.world_size, 1))  # tokens are every device's
            logs["mfu"] = mfu
            parts.append(f"MFU {100 * mfu:.1f}%")
        if dstep > 0 and state.max_steps > 0:
            parts.append(f"ETA {eta((state.max_steps - state.global_step) * dt / dstep)}")
        line = " | ".join(parts)
        self.lines.append(line)
        self._print(line, state)

    def _print(self, line: str, state) -> None:
        if state.is_world_process_zero:
            if self.out is not None:
                print(line, file=self.out, flush=True)
            else:
                from tqdm.auto import tqdm

                tqdm.write(line, file=sys.stderr)
