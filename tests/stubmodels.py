"""Stub captioning models for the attention diagnostics' tests (tests/test_diagnostics*.py)."""
import torch.nn as nn


class RecordingStub(nn.Module):
    """What the gradient-importance diagnostic reads of a model besides `encode` and `decode`: one `decoder` entry
    per layer, `memory`, and the attention recording switch. The recorded attention and mask are fixed per-layer
    tensors chosen by the test, so the test knows the ranking they give; a subclass gives `encode` and `decode`,
    and `decode` calls `_record` with how to shape the fixed tensors into a pass's (B, H, T, R)."""

    def __init__(self, attention, mask):
        super().__init__()
        self.decoder = nn.ModuleList(nn.Identity() for _ in attention)
        self.attention, self.mask = attention, mask
        self.record, self._last = False, []

    def memory(self, enc):
        return enc

    def record_attention(self, on=True):
        self.record = on

    def recorded_attention(self):
        return self._last

    def _record(self, shape):
        if self.record:
            self._last = [{"attention": shape(a), "aligned": shape(a), "mask": shape(m)}
                          for a, m in zip(self.attention, self.mask)]
