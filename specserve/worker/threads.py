"""How many threads each forward pass gets, chosen by measurement rather than assumed.

On a dedicated 2-core machine two threads speed up multi-token steps (verification, prefill) by up to
1.5x; on a shared one, every OpenMP parallel region may wait a scheduler tick for its second thread and
the same step can run 2x slower. So per step-size bucket the policy keeps a moving average of seconds per
token for each thread count, uses the faster, and re-measures the other now and then.
The averages take a faster step at once and a slower one a little at a time (SLOWER_CLIP).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

# Lower bounds of the step-size buckets, in tokens. Each verification size up to 8 is its own bucket: a
# bucket compares seconds per token, and across 2-16 tokens that ratio halves with the size, so in a wider
# bucket a choice measured on bigger steps would look faster (a 2-16 bucket can settle on 1 thread while
# 2 threads run each size faster).
BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64)
SKIP_FIRST_BELOW = 17  # the first step of each size below this is not measured (see record)
# Steps of a bucket between two measurements of the other choice. Each one costs a step at the slower
# setting (1.4-1.8x the time on 2 cores), so every 16 steps the exploring alone would cost ~3% of a
# 32-request decode.
EXPLORE_EVERY = 64
# An exploring step that ran this much slower than the choice in use doubles the interval to the next one,
# up to MAX_EXPLORE_EVERY: with another process busy on one core, a 2-thread step with spinning OpenMP
# workers takes ~2x a 1-thread one, which re-measured every 64 steps would cost ~2% for nothing.
SLOW_EXPLORE = 1.5
# A bucket whose other choice measured at least this much slower skips the re-measurements at steps 8, 16
# and 32 (a decode size's step 4 still checks the first pick; a prefill's, ~0.5 s more on one thread for
# 1000 tokens, does not), and a new bucket borrows the verdict when every measured bucket of its kind
# (decode/verification sizes, or prefill sizes) agrees this clearly. A prompt-lookup request spreads its
# steps over nine sizes; each size measuring one thread five times in its first 32 steps would run ~20 of
# a summarization request's ~87 steps on one thread, ~1.15-1.45x slower on 2 cores.
CLEAR_MARGIN = 1.1
MAX_EXPLORE_EVERY = 1024
EMA = 0.7  # weight of the history in the moving averages
# A step slower than its average counts as at most this much slower: one step that another process slowed 2x
# (common on a shared host) would otherwise make the faster choice look slower for a whole level of a run;
# a host that turns slower for good is followed within ~10 steps of each choice.
SLOWER_CLIP = 0.25
# A step of more tokens than this never runs the other choice to measure it: one thread on a 2,000-token
# prefill takes ~0.5 s more than two on 2 cores, enough to make a first run of four prompts at once ~8%
# slower. It runs the faster choice measured on its bucket's smaller steps, or all threads while only those
# are measured (a long step's parallel regions are long, so a second thread that starts late costs little).
EXPLORE_MAX_TOKENS = 256


class ThreadPolicy:
    def __init__(self, max_threads: int | None = None) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.choices = sorted({1, self.max_threads}, reverse=True)  # all threads first: the usual winner
        self.seconds: dict[tuple[int, int], float] = {}  # (bucket, threads) -> seconds per token, averaged
        self.steps: dict[int, int] = {}
        self.seen_sizes: set[int] = set()
        self.interval: dict[int, int] = {}  # bucket -> steps between explorations, from step EXPLORE_EVERY on
        self.next_explore: dict[int, int] = {}
        self.exploring: set[int] = set()  # buckets whose current step runs the other choice
        self.runs: dict[int, int] = {}  # steps run, by thread count

    def _bucket(self, num_tokens: int) -> int:
        return max(b for b in BUCKETS if num_tokens >= b)

    def choose(self, num_tokens: int) -> int:
        bucket = self._bucket(num_tokens)
        if num_tokens > EXPLORE_MAX_TOKENS:
            measured = [t for t in self.choices if (bucket, t) in self.seconds]
            return min(measured, key=lambda t: self.seconds[(bucket, t)]) if measured else self.choices[0]
        self.steps[bucket] = step = self.steps.get(bucket, 0) + 1
        unmeasured = [t for t in self.choices if (bucket, t) not in self.seconds]
        if unmeasured:
            borrowed = self._verdict_of_similar(bucket) if len(unmeasured) < len(self.choices) else None
            return borrowed if borrowed is not None and step < EXPLORE_EVERY else unmeasured[0]
        best = min(self.choices, key=lambda t: self.seconds[(bucket, t)])
        # Re-measure the other choice at steps 4, 8, 16, 32 (a clear verdict: only a decode size's step 4), then every
        # EXPLORE_EVERY: an early wrong pick (one noisy step) is corrected quickly, a settled one costs little.
        if step >= EXPLORE_EVERY:
            explore = step >= self.next_explore.get(bucket, EXPLORE_EVERY)
            if explore:
                self.next_explore[bucket] = step + self.interval.get(bucket, EXPLORE_EVERY)
        else:
            settled = self._clear_best(bucket) is not None
            explore = step >= 4 and step & (step - 1) == 0 and not (
                settled and (step > 4 or bucket >= SKIP_FIRST_BELOW))
        if explore and len(self.choices) > 1:
            self.exploring.add(bucket)
            return next(t for t in self.choices if t != best)
        return best

    def _clear_best(self, bucket: int) -> int | None:
        """The bucket's choice when every other one measured at least CLEAR_MARGIN slower, else None."""
        times = [self.seconds.get((bucket, t)) for t in self.choices]
        if None in times or len(times) < 2:
            return None
        ordered = sorted(zip(times, self.choices))
        return ordered[0][1] if ordered[1][0] >= CLEAR_MARGIN * ordered[0][0] else None

    def _verdict_of_similar(self, bucket: int) -> int | None:
        """The clear choice every fully measured bucket of the same kind agrees on, else None."""
        small = bucket < SKIP_FIRST_BELOW
        similar = {b for b, _ in self.seconds if b != bucket and (b < SKIP_FIRST_BELOW) == small}
        verdicts = {self._clear_best(b) for b in similar if all((b, t) in self.seconds for t in self.choices)}
        return verdicts.pop() if len(verdicts) == 1 and None not in verdicts else None

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        if num_tokens < SKIP_FIRST_BELOW and num_tokens not in self.seen_sizes:
            # A new small step size builds new oneDNN kernels (where the C GEMM is unavailable), a large
            # share of a ~25 ms step; buffers of a new size are first touched: skip it.
            self.seen_sizes.add(num_tokens)
            self.exploring.discard(self._bucket(num_tokens))  # an exploration that measured nothing
            return
        bucket = self._bucket(num_tokens)
        key = (bucket, threads)
        per_token = seconds / max(num_tokens, 1)
        if bucket in self.exploring:
            self.exploring.discard(bucket)
            in_use = min((v for (b, t), v in self.seconds.items() if b == bucket and t != threads), default=None)
            slow = in_use is not None and per_token > SLOW_EXPLORE * in_use
            interval = min(2 * self.interval.get(bucket, EXPLORE_EVERY), MAX_EXPLORE_EVERY) if slow else EXPLORE_EVERY
            self.interval[bucket] = interval
            if self.steps.get(bucket, 0) >= EXPLORE_EVERY:
                self.next_explore[bucket] = self.steps[bucket] + interval  # the new interval, from this step
        old = self.seconds.get(key)
        if old is None or per_token <= old:  # other work on the host only ever adds time: a faster step is the truth
            self.seconds[key] = per_token
        else:  # a slower one may be a step that other work slowed: it moves the average a little at a time
            self.seconds[key] = EMA * old + (1 - EMA) * min(per_token, old * (1 + SLOWER_CLIP))

    @contextmanager
    def run(self, num_tokens: int):
        """Run a step with the chosen thread count, record its time, restore the thread count."""
        threads = self.choose(num_tokens)
        self.runs[threads] = self.runs.get(threads, 0) + 1
        torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            yield threads
        finally:
            self.record(num_tokens, threads, time.perf_counter() - start)
            torch.set_num_threads(self.max_threads)
