"""Layer: comm. What qgZ's error feedback keeps between steps: the quantization error of one
FSDP group's reduction at one hop, fp32 or int8 blocks ([Note: qgZ error feedback] in
comm/zeropp.py, which calls it; checkpoint/comm_state.py saves it)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from zeropp_strategy.kernels import code_dtype, dequantize, quantize_into, quantized_nbytes

__all__ = ["FEEDBACK_PIECE_ELEMS", "FEEDBACK_ROW_ELEMS", "INTRA_FEEDBACK", "ErrorFeedback"]

INTRA_FEEDBACK = "qgZ intra-node error feedback"  # the name of step 1's kept error
# Step 1's feedback works on whole chunks, as many at a time as fit in this many elements (or
# one): three fp32 rows of it are its scratch, and fewer rows are fewer kernel launches
# (comm/zeropp.py takes them so; cost.py counts the scratch).
FEEDBACK_ROW_ELEMS = 1 << 24
# On the CPU a row goes through in pieces of about this many elements, each in cache for all
# of its passes (as the kernels' reference works: [Note: fast CPU reference]): the
# reference's chunk size. Against the code before it, 2^20 took 0.51-0.75x its time per call
# at 4M-8M elements and 2^18 0.58-0.87x (docs/zeropp_measurements.md, "Error feedback in
# pieces"); `python benchmarks/kernels.py --cpu-suite --chunk-sweep --ops
# ErrorFeedback.quantize_rows` times other piece sizes (the reference's chunk set to each too).
FEEDBACK_PIECE_ELEMS = 1 << 20


class ErrorFeedback:
    """The kept quantization error of one group's reduction at one of qgZ's hops ([Note: qgZ
    error feedback]): the node partials' error across nodes, or with ``stored_bits=8`` the
    whole gradient's error inside the node, kept as int8 blocks of ``block_elems``."""

    name = "qgZ error feedback"

    def __init__(self, *, beta: float, reset_steps: int, layout: tuple[int, int] = (1, 1),
                 stored_bits: int = 32, block_elems: int = 64, name: str | None = None) -> None:
        self.beta = beta
        self.reset_steps = reset_steps
        self.layout = layout  # (nodes, ranks per node): the error means nothing on another
        self.stored_bits, self.block_elems = stored_bits, block_elems  # 32: fp32; 8: int8 codes + fp32 scales
        if name is not None:
            self.name = name
        # the names every kept state has (WeightDeltas' too), which checkpoint/comm_state.py saves
        self.kept: torch.Tensor | None = None  # the error e: fp32 of the partials' shape, or its int8 payload
        self.count = 0  # reductions so far (the reset counts them)

    def part(self, rank: int) -> torch.Tensor | None:  # noqa: ARG002 - each rank's errors are its own
        return self.kept

    def sources(self, rank: int) -> list[int]:
        return [rank]

    def restore(self, parts: list[torch.Tensor | None]) -> None:
        (self.kept,) = parts

    def _kept(self, n: int, device: torch.device) -> torch.Tensor:
        """The kept error of ``n`` elements as stored (fp32, or int8 codes then fp32 scales in
        one uint8 tensor): zeros when none is kept (or of another size), at a periodic reset,
        and at the first reduction (zero codes with zero scales decode to zero)."""
        size = n if self.stored_bits == 32 else quantized_nbytes(n, self.block_elems, 8)
        kept = self.kept
        if kept is None or kept.numel() != size or (self.reset_steps and self.count % self.reset_steps == 0):
            return torch.zeros(size, dtype=torch.float32 if self.stored_bits == 32 else torch.uint8, device=device)
        return kept.to(device)  # a no-op but after a load from a checkpoint

    def quantize(self, partials: torch.Tensor, block_elems: int, bits: int, *,
                 bf16_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and scales of ``partials + error`` (fp32, whole blocks; used as scratch), and
        the error updated with what this quantization dropped."""
        flat = partials.view(-1)
        return self.quantize_rows(1, flat.numel(), lambda i: flat, block_elems, bits, bf16_scales=bf16_scales,
                                  device=flat.device)

    def quantize_rows(self, rows: int, row_elems: int, row: Callable[[int], torch.Tensor], block_elems: int,
                      bits: int, *, bf16_scales: bool = False,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize`` of ``rows`` rows of ``row_elems`` elements (whole blocks) back to back,
        one row at a time: ``row(i)`` gives row i in fp32, which this call overwrites, so no
        scratch is larger than a row's. A non-finite error (an inf or NaN gradient) is kept
        as zero, so that one bad step does not spoil its blocks until the next reset.

        On the CPU a row goes through in pieces of about ``FEEDBACK_PIECE_ELEMS`` elements
        (whole blocks of both block sizes), each in cache for all of its passes, and no
        temporary is as large as a row; the blocks are those of whole rows, and so are the
        codes and scales (a NaN scale's payload bits aside). ``kernels.quantize_into`` writes
        the codes where they go and leaves what they drop in the row."""
        B, n = block_elems, rows * row_elems
        eb = self.block_elems
        assert row_elems % B == 0 and row_elems % eb == 0, (row_elems, B, eb)
        kept, beta = self._kept(n, device), self.beta
        self.count += 1
        codes = torch.empty(n * bits // 8, dtype=code_dtype(bits), device=device)
        scales = torch.empty(n // B, dtype=torch.float32, device=device)
        int8_kept = self.stored_bits != 32
        if int8_kept:  # int8 codes of all n elements, then their fp32 scales
            kept_codes, kept_scales = kept[:n].view(torch.int8), kept[n:].view(torch.float32)
        unit = math.lcm(B, eb)  # a piece holds whole blocks of both sizes
        piece = row_elems if device.type != "cpu" else min(row_elems, max(unit, FEEDBACK_PIECE_ELEMS // unit * unit))
        error_buf = torch.empty(piece, dtype=torch.float32, device=device) if int8_kept else None
        for i in range(rows):
            row_i = row(i)
            for a in range(i * row_elems, (i + 1) * row_elems, piece):  # a: the piece's first element of n
                m = min(piece, (i + 1) * row_elems - a)
                compensated = row_i[a - i * row_elems:a - i * row_elems + m]
                if int8_kept:
                    error = dequantize(kept_codes[a:a + m], kept_scales[a // eb:(a + m) // eb], eb, m, 8,
                                       out=error_buf[:m])
                else:
                    error = kept[a:a + m]  # updated in place
                compensated.add_(error)
                quantize_into(compensated, codes[a * bits // 8:(a + m) * bits // 8], scales[a // B:(a + m) // B], B,
                              bits, bf16_scales=bf16_scales, residual=True)  # compensated: now what was dropped
                torch.nan_to_num_(error.mul_(beta).add_(compensated, alpha=1.0 - beta), nan=0.0, posinf=0.0,
                                  neginf=0.0)
                if int8_kept:
                    quantize_into(error, kept_codes[a:a + m], kept_scales[a // eb:(a + m) // eb], eb, 8)
        self.kept = kept
        return codes, scales
