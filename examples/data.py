"""Data for the example GPT: a byte corpus with a held-out tail, and batch samplers deterministic from
``(seed, step, rank)``.

* Default corpus: the bytes of this Python's standard-library source, every ``*.py`` under
  ``sysconfig.get_paths()["stdlib"]`` (``site-packages``/``dist-packages`` excluded, since installed
  packages differ between machines), sorted by relative path and concatenated with one ``b"\\n"`` between
  files.  It is the same on every machine with the same Python version (3.11 gives ~31 MB; another version
  gives a slightly different corpus, so compare losses only between runs on the same Python).
* ``--data PATH...``: the user's files (directories are walked for regular files, all sorted by path).
* The last ``heldout_frac`` (default 5%) of the bytes is held out for evaluation, the rest is training data.
* Batches are random windows drawn from a generator seeded by ``(seed, step, micro, rank)`` only, so every
  config (ZeRO-3, ZeRO++, sdp4bit) sees exactly the same data order, and a resumed run continues it.
* :class:`RandomTokens` samples uniform token ids (vocab 50304 by default) for throughput runs.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

HELDOUT_FRAC = 0.05
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> List[Path]:
    """The ``*.py`` files of the running Python's standard library, sorted by path relative to its root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the standard-library directory {root} does not exist; pass --data PATH")
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _expand(paths: Iterable[str]) -> List[Path]:
    out: List[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            # Hidden files and bytecode caches are not text anyone meant to train on.
            out.extend(sorted((q for q in p.rglob("*") if q.is_file() and q.suffix != ".pyc" and not any(
                part.startswith(".") or part in _EXCLUDED_DIRS for part in q.relative_to(p).parts)),
                key=lambda q: q.as_posix()))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"--data: {raw!r} is neither a file nor a directory")
    return out


def load_corpus(paths: Optional[Sequence[str]] = None) -> Tuple[torch.Tensor, str]:
    """Load the corpus as a flat uint8 tensor of shape (n_bytes,), plus a one-line description.

    Args:
        paths: files or directories to read (in the given order; each directory's files sorted by path), or
            None for the standard-library corpus.
    """
    files = stdlib_files() if not paths else _expand(paths)
    if not files:
        raise ValueError("the corpus has no files" + (f" under {list(paths)}" if paths else ""))
    chunks = []
    for f in files:
        chunks.append(f.read_bytes())
        chunks.append(b"\n")
    blob = b"".join(chunks)
    desc = (f"stdlib of Python {sysconfig.get_python_version()} ({len(files)} files, {len(blob)} bytes)"
            if not paths else f"{len(files)} user files ({len(blob)} bytes)")
    # bytearray: torch.frombuffer wants a writable buffer to avoid a warning; the copy is made once.
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), desc


def split_corpus(data: torch.Tensor, heldout_frac: float = HELDOUT_FRAC) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split a flat (n,) tensor into (train, held-out): the held-out part is the last ``heldout_frac``."""
    if data.dim() != 1:
        raise ValueError(f"data must be a flat (n,) tensor, got shape {tuple(data.shape)}")
    if not 0.0 < heldout_frac < 1.0:
        raise ValueError(f"heldout_frac must be in (0, 1), got {heldout_frac}")
    cut = int(round(data.numel() * (1.0 - heldout_frac)))
    return data[:cut], data[cut:]


_MASK64 = (1 << 64) - 1


def _mix(*ints: int) -> int:
    """A 63-bit seed from a tuple of ints (splitmix64 finaliser chained over the inputs)."""
    h = 0x9E3779B97F4A7C15
    for v in ints:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & ((1 << 63) - 1)


# Stream tags keep the training and evaluation draws independent of each other.
_TRAIN, _EVAL = 1, 2


class WindowSampler:
    """Random windows of a flat token tensor, deterministic from ``(seed, step, micro, rank)``.

    Args:
        data: flat uint8/int tensor (n,) with n > seq_len + 1.
        seq_len: tokens per sample (T).
        micro_batch: samples per micro-batch (B).
        seed: the data seed (independent of the model seed).
        rank, world_size: this rank's data-parallel index and the number of ranks.
    """

    def __init__(self, data: torch.Tensor, seq_len: int, micro_batch: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        if data.dim() != 1:
            raise ValueError(f"data must be a flat (n,) tensor, got shape {tuple(data.shape)}")
        if seq_len < 1 or micro_batch < 1:
            raise ValueError(f"seq_len and micro_batch must be >= 1, got {seq_len} and {micro_batch}")
        if data.numel() < seq_len + 2:
            raise ValueError(f"the data ({data.numel()} tokens) is shorter than seq_len + 2 = {seq_len + 2}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.data, self.seq_len, self.micro_batch = data, seq_len, micro_batch
        self.seed, self.rank, self.world_size = int(seed), rank, world_size

    def _windows(self, key: int) -> Tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(key)
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (self.micro_batch,), generator=gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        tok = self.data[idx].long()
        return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

    def batch(self, step: int, micro: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Training (inputs, targets), each int64 (B, T), for optimizer step ``step``, micro-batch ``micro``."""
        return self._windows(_mix(self.seed, _TRAIN, step, micro, self.rank))

    def eval_batch(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Evaluation batch ``i`` (B, T) of this rank: the same windows at every evaluation."""
        return self._windows(_mix(self.seed, _EVAL, i, self.rank))


class RandomTokens:
    """Uniform random token ids for throughput runs; same interface as :class:`WindowSampler`.

    Args:
        vocab: token ids are drawn from [0, vocab).
        seq_len, micro_batch, seed, rank, world_size: as for :class:`WindowSampler`.
    """

    def __init__(self, vocab: int, seq_len: int, micro_batch: int, seed: int, rank: int = 0, world_size: int = 1):
        if vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {vocab}")
        if seq_len < 1 or micro_batch < 1:
            raise ValueError(f"seq_len and micro_batch must be >= 1, got {seq_len} and {micro_batch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.vocab, self.seq_len, self.micro_batch = vocab, seq_len, micro_batch
        self.seed, self.rank, self.world_size = int(seed), rank, world_size

    def _draw(self, key: int) -> Tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(key)
        tok = torch.randint(0, self.vocab, (self.micro_batch, self.seq_len + 1), generator=gen)
        return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

    def batch(self, step: int, micro: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 (B, T)."""
        return self._draw(_mix(self.seed, _TRAIN, step, micro, self.rank))

    def eval_batch(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 (B, T); the expected loss is ln(vocab)."""
        return self._draw(_mix(self.seed, _EVAL, i, self.rank))


def build_samplers(*, data_paths: Optional[Sequence[str]], random_tokens: bool, vocab: int, seq_len: int,
                   micro_batch: int, seed: int, rank: int, world_size: int,
                   heldout_frac: float = HELDOUT_FRAC):
    """(train_sampler, eval_sampler, description) for the training script.

    With ``random_tokens`` both samplers draw uniform ids in [0, vocab); otherwise the corpus (bytes, so
    ``vocab`` must be >= 256) is split into train and held-out parts.
    """
    if random_tokens:
        if data_paths:
            raise ValueError("--random-tokens and --data are exclusive")
        s = RandomTokens(vocab, seq_len, micro_batch, seed, rank, world_size)
        return s, s, f"random tokens (vocab {vocab})"
    if vocab < 256:
        raise ValueError(f"byte corpora need vocab >= 256, got {vocab}")
    data, desc = load_corpus(data_paths)
    train, held = split_corpus(data, heldout_frac)
    return (WindowSampler(train, seq_len, micro_batch, seed, rank, world_size),
            WindowSampler(held, seq_len, micro_batch, seed, rank, world_size),
            f"{desc}; train {train.numel()} / held-out {held.numel()} bytes")


if __name__ == "__main__":  # a quick look at the corpus: python examples/data.py [PATH...]
    import sys
    d, description = load_corpus(sys.argv[1:] or None)
    print(description)
    tr, ho = split_corpus(d)
    x, y = WindowSampler(tr, 64, 2, seed=0).batch(0)
    print(bytes(x[0].to(torch.uint8).tolist()).decode("utf-8", "replace"))
