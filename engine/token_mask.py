"""Each step's token masks for the sequences that follow a grammar (structured outputs).

A mask needs every earlier token of its sequence: the runner asks for a step's masks when it samples the step, which
is after the previous step's tokens have been read on the host (with async scheduling too: LLMEngine.step reads
them before it samples the step it has just launched). The masks are filled by llguidance's thread pool into one
pinned buffer, copied to the logits' device at once (on a stream of its own, beside the forward pass); the sampler
then bans the masked tokens of the constrained rows only (kernels.apply_token_bitmask_, or inside the argmax of a
plain greedy step: kernels.masked_argmax), so the other rows of the step cost nothing more. The pool fills rows in
parallel only where their matchers have different lexers (engine/grammar.py's CompiledGrammar spreads them).

With async scheduling the work starts a step early: once a step's tokens are sampled on the device (start_ahead),
a worker thread waits for them to reach the host, has each constrained sequence's matcher consume its new token and
fills the masks the next step will need, while the engine thread schedules and launches that step and processes
the tokens. The next step takes the rows whose matcher is still exactly where the worker left it and fills any
others itself; when all of them are, in the same order, the worker's buffer is copied to the device as it is.
Only the worker or the engine thread touches the matchers at any time: the engine thread waits for the worker
before it does. The worker holds the GIL only between its three native calls (the wait for the tokens, consuming
them, filling the masks): each time it takes the GIL back it may wait for the engine thread to let it go.

With mask processes on a CUDA device, a steady step's masks are waited for by the GPU rather than the engine thread
(for_step with `deferred`): their copy waits on the processes' counters (MaskProcesses.wait_on_device), the engine
thread launches the sampling and goes on, and collects the round trip once it has launched the next forward pass
(forward_launched), which is also when it hands the processes the tokens of the step it sampled (their copy from
the device was queued behind the sampling). The engine must call forward_launched before it waits for the device
in any way: a process that died holds the GPU until then, when its successor fills its rows."""

from __future__ import annotations

import operator
import time
import weakref
from collections.abc import Sequence as SequenceOf
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.deferred_tokens import DeferredTokens
from engine.grammar import SequenceGrammar, mask_threads
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.mask_processes import MaskProcesses


@dataclass
class TokenBitmask:
    """rows [K] int64: the logits rows to mask; words [K, W] int32: bit j of word w allows token 32 * w + j;
    mask_of_row [N] int32: for each logits row of the step, its row of words (-1: none), for kernels.masked_argmax."""

    rows: torch.Tensor
    words: torch.Tensor
    mask_of_row: torch.Tensor


@dataclass
class _Ahead:
    """Masks filled ahead by the worker: row i of words is the mask of grammars[i] after num_consumed[i] tokens.
    Weak references: a finished sequence's matcher is not kept alive by masks nobody will use."""

    grammars: list[weakref.ref[SequenceGrammar]]
    num_consumed: list[int]
    words: torch.Tensor
    half: int = -1  # with mask processes: the half of their buffer words is in

    def serves(self, seqs: SequenceOf[Sequence]) -> bool:
        """Whether row i is the mask seqs[i] needs now, for every i and no other row."""
        return len(seqs) == len(self.grammars) and all(
            ref() is seq.grammar and num_consumed == seq.grammar.num_consumed and not seq.grammar.new_tokens(seq)
            for ref, num_consumed, seq in zip(self.grammars, self.num_consumed, seqs))

    def rows_by_grammar(self) -> dict[int, tuple[int, int, SequenceGrammar]]:
        """id of each grammar still alive -> (row, tokens consumed, the grammar: held while the dict is)."""
        out = {}
        for row, (ref, num_consumed) in enumerate(zip(self.grammars, self.num_consumed)):
            grammar = ref()
            if grammar is not None:
                out[id(grammar)] = (row, num_consumed, grammar)
        return out


@dataclass
class _Steady:
    """The last hand-over to the mask processes, where it sent every constrained row of its step: `seqs` is that
    step's batch (held weakly: a finished batch is not kept alive), `rows` its constrained rows (row i of the
    processes' buffer is seqs[rows[i]]'s mask). While the next batches are the same sequences in the same rows,
    their masks all served from the round trip before and no grammar gone (MaskProcesses.unchanged), each step's
    masks and hand-over need no work per sequence: every constrained sequence has read exactly one token since, and
    its grammar is the one the processes' plans hold."""

    pool: MaskProcesses
    seqs: list[weakref.ref[Sequence]]
    rows: list[int]
    ahead: _Ahead
    served: bool = False  # for_step took `ahead` for the same batch: the next hand-over may be steady
    device_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # TokenBitmask's rows and mask_of_row
    words: dict[int, torch.Tensor] = field(default_factory=dict)  # the buffer's halves, cut to len(rows)
    # the batch list same_batch last found the same: a step's list is asked about again (the masks, the tokens'
    # hand-over) and never changed; held until that hand-over, which its tokens keep alive as long anyway
    checked: SequenceOf[Sequence] | None = None

    def same_batch(self, seqs: SequenceOf[Sequence]) -> bool:
        if seqs is self.checked:
            return True
        same = len(seqs) == len(self.seqs) and all(map(operator.is_, seqs, map(weakref.ref.__call__, self.seqs)))
        self.checked = seqs if same else None
        return same


def _tokens_before_pending(seq: Sequence) -> int:
    """The sequence's output tokens known on the host, its placeholder for a token still being read left out."""
    return seq.num_output_tokens - (seq.pending_row >= 0)


class TokenMasker:
    def __init__(self, device: torch.device, threads: int | None = None) -> None:
        """`threads`: llguidance's pool size (mask_threads() when not given)."""
        self.device = device
        self.threads = threads or mask_threads()
        self._executor = None
        self._worker: ThreadPoolExecutor | None = None
        self._ahead: Future[_Ahead] | None = None
        self._to_send: DeferredTokens | None = None  # mask processes: tokens to send once read
        # their round trip under way: the pool, the masks it fills, and (step's batch, rows sent, tokens) to name
        # the sequence and token of a refusal
        self._in_processes: tuple[MaskProcesses, _Ahead,
                                  tuple[list[Sequence], list[int], list[int] | DeferredTokens]] | None = None
        self.hand_over_from_device = True  # a steady step's tokens go to the mask processes from the device
        self.masks_waited_on_device = True  # the GPU, not the engine thread, waits for a steady step's masks
        self._waited = False  # the round trip in the processes is one the GPU waits for: collect before the host does
        self._staged = False  # _to_send's tokens are being copied to the processes from the device (start_ahead)
        self._steady: _Steady | None = None
        self._half = 0  # the half of the processes' buffer the next round trip ahead fills
        # the logits rows of the last masks and the step's number of rows, and their device tensors (_device_rows)
        self._rows_key: tuple[tuple[int, ...], int] = ((), 0)
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._copy_stream: torch.cuda.Stream | None = None  # the masks' copies to a CUDA device (_on_device)
        # _upload_waited's: a device buffer per half of the mask processes' buffer, the pool they are for, the
        # event behind each copy, and each copy's pointers by (half, rows)
        self._device_halves: list[torch.Tensor] = []
        self._device_halves_of: MaskProcesses | None = None
        self._copied: int | None = None
        self._device_index = -1
        self._uploads: dict[tuple[int, int], tuple[torch.Tensor, int, int, int, int]] = {}
        # totals over the engine's life, for benchmarks: engine-thread seconds spent on masks (waiting for the
        # worker included), worker seconds, seconds in llguidance's calls on either thread (taking the GIL back
        # after each included), steps with masks, rows, rows the worker had ready; with mask processes, the engine
        # thread's seconds sending them the tokens and collecting the masks filled ahead (the wait included)
        self.seconds = 0.0
        self.send_seconds = 0.0
        self.collect_seconds = 0.0
        self.ahead_seconds = 0.0
        self.native_seconds = 0.0
        self.steps = 0
        self.rows = 0
        self.rows_ahead = 0
        self.steps_steady = 0  # steps whose masks and hand-over took the steady path (_Steady)
        self.hand_overs_early = 0
        self.hand_overs_from_device = 0
        self.steps_waited_on_device = 0

    @property
    def executor(self):
        """llguidance's thread pool, made on first use."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self.threads)
        return self._executor

    def for_step(self, seqs: SequenceOf[Sequence], deferred: bool = False) -> TokenBitmask | None:
        """The masks of the rows (one per sequence, in order) whose sequence follows a grammar; None without any.
        `deferred`: the caller reads nothing the device computes with them before it calls forward_launched (the
        GPU may wait for them)."""
        if self._to_send is not None:  # tokens_read was not called: they are read by now
            self._send_ahead()
        elif self._waited:  # served, and no step's tokens came after it
            self._collect()
        steady = self._steady
        if (steady is not None and self._in_processes is not None and self._in_processes[1] is steady.ahead
                and steady.same_batch(seqs) and steady.pool.unchanged()):
            bitmask = self._serve_steady(steady, deferred)
            if bitmask is not None:
                return bitmask
            ahead = steady.ahead  # collected, with a refusal or a process started again: checked row by row
        else:
            ahead = self._take_ahead()
        self._steady = None
        constrained = [(row, seq) for row, seq in enumerate(seqs) if seq.grammar is not None]
        if not constrained:
            return None
        started = time.perf_counter()
        constrained_seqs = [seq for _, seq in constrained]
        pool = constrained_seqs[0].grammar.pool
        if ahead is not None and ahead.serves(constrained_seqs):
            words, num_ahead = ahead.words, len(constrained)
        elif pool is not None:
            words, num_ahead = self._assemble_in_processes(pool, constrained_seqs, ahead)
        else:
            words, num_ahead = self._assemble(constrained_seqs, ahead)
        rows, mask_of_row = self._device_rows(tuple(row for row, _ in constrained), len(seqs))
        bitmask = TokenBitmask(rows, self._on_device(words), mask_of_row)
        self.seconds += time.perf_counter() - started
        self.steps += 1
        self.rows += len(constrained)
        self.rows_ahead += num_ahead
        return bitmask

    def _serve_steady(self, steady: _Steady, deferred: bool) -> TokenBitmask | None:
        """The steady step's masks: the round trip's buffer as it is (None if it booked a refusal or a process had
        to be started again). With `deferred` on a device that can, the round trip is left to finish: the copy of
        the buffer to the device waits for it there."""
        waited = (deferred and self.masks_waited_on_device and self.device.type == "cuda"
                  and steady.pool.can_wait_on_device)
        if not waited:
            self._collect()
            if self._steady is not steady:
                return None
        started = time.perf_counter()
        if steady.device_rows is None:
            steady.device_rows = self._device_rows(tuple(steady.rows), len(steady.seqs))
        rows, mask_of_row = steady.device_rows
        words = self._upload_waited(steady.ahead, steady.pool) if waited else self._on_device(steady.ahead.words)
        bitmask = TokenBitmask(rows, words, mask_of_row)
        self._waited = waited
        self.steps_waited_on_device += waited
        steady.served = True
        self.seconds += time.perf_counter() - started
        self.steps += 1
        self.steps_steady += 1
        self.rows += len(steady.rows)
        self.rows_ahead += len(steady.rows)
        return bitmask

    def _assemble(self, seqs: list[Sequence], ahead: _Ahead | None) -> tuple[torch.Tensor, int]:
        """The masks of seqs, in order: the worker's rows that are still current, the others filled now; and how
        many came from the worker."""
        words, fresh = self._copy_current(seqs, ahead)
        if fresh:
            self._catch_up([seqs[i] for i in fresh])
            self._fill(words, [(seqs[i].grammar.matcher, i) for i in fresh])
        return words, len(seqs) - len(fresh)

    def _copy_current(self, seqs: list[Sequence], ahead: _Ahead | None) -> tuple[torch.Tensor, list[int]]:
        """A host buffer with a row per sequence, holding the rows filled ahead that are still the sequence's mask;
        and the indices of the sequences whose row is still to fill."""
        words = self._new_words(len(seqs), seqs[0].grammar.mask_words)
        ready = ahead.rows_by_grammar() if ahead is not None else {}
        copied, copied_from, fresh = [], [], []
        for i, seq in enumerate(seqs):
            found = ready.get(id(seq.grammar))
            if (found is not None and found[2] is seq.grammar and found[1] == seq.grammar.num_consumed
                    and not seq.grammar.new_tokens(seq)):
                copied.append(i)
                copied_from.append(found[0])
            else:
                fresh.append(i)
        if copied:
            words[copied] = ahead.words[copied_from]
        return words, fresh

    def _new_words(self, num_rows: int, mask_words: int) -> torch.Tensor:
        """A host buffer for masks: pinned for a CUDA device (the caching host allocator reuses a block only once
        the copies that read it are done)."""
        return torch.empty((num_rows, mask_words), dtype=torch.int32, pin_memory=self.device.type == "cuda")

    def _on_device(self, words: torch.Tensor) -> torch.Tensor:
        """The masks on the logits' device. On CUDA they are copied on a stream of their own, so the copy runs beside
        the forward pass queued before the sampler rather than after it (the host has the masks long before the
        GPU needs them when the step is GPU-bound); the sampler's stream waits for the copy."""
        if self.device.type != "cuda":
            return words.to(self.device)
        with torch.cuda.stream(self.copy_stream):
            on_device = words.to(self.device, non_blocking=True)
        sampler_stream = torch.cuda.current_stream(self.device)
        sampler_stream.wait_stream(self.copy_stream)
        on_device.record_stream(sampler_stream)  # its block is not reused before the sampler has read it
        return on_device

    @property
    def copy_stream(self) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream

    def _upload_waited(self, ahead: _Ahead, pool: MaskProcesses) -> torch.Tensor:
        """_on_device for the masks of a round trip still under way: their copy waits on the device for the mask
        processes (MaskProcesses.wait_on_device), into a device buffer kept for their half of the processes' buffer
        (the copy that next writes it follows the sampling that read it: the processes fill that half only once
        they have the tokens of the step after). Launched with the driver's calls (engine/stream_ops.py)."""
        ops = pool.stream_ops
        if self._device_halves_of is not pool:
            self._uploads.clear()
            self._device_halves = [torch.empty(pool.buffer(h).shape, dtype=torch.int32, device=self.device)
                                   for h in (0, 1)]
            self._device_halves_of = pool
            self._copied = self._copied or ops.new_event()
            self._device_index = self._device_halves[0].device.index
        key = (ahead.half, ahead.words.shape[0])
        found = self._uploads.get(key)
        if found is None:
            target = self._device_halves[ahead.half][: ahead.words.shape[0]]
            found = self._uploads[key] = (target, target.data_ptr(), ahead.words.data_ptr(), ahead.words.nbytes,
                                          self.copy_stream.cuda_stream)
        target, destination, source, nbytes, copy_stream = found
        pool.wait_on_device(copy_stream)
        ops.copy_to_device(destination, source, nbytes, copy_stream)
        ops.record(self._copied, copy_stream)
        ops.wait_event(ops.current_stream(self._device_index), self._copied)
        return target

    def _device_rows(self, rows: tuple[int, ...], num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """TokenBitmask's rows and mask_of_row on the device for a step of num_rows logits rows; the last step's
        tensors when they are the same (a steady batch), which the kernels only read."""
        key = (rows, num_rows)
        if key != self._rows_key or self._rows is None:
            mask_of_row = [-1] * num_rows
            for k, row in enumerate(rows):
                mask_of_row[row] = k
            host = (torch.tensor(rows, dtype=torch.int64), torch.tensor(mask_of_row, dtype=torch.int32))
            if self.device.type == "cuda":
                host = tuple(t.pin_memory() for t in host)
            self._rows_key, self._rows = key, tuple(t.to(self.device, non_blocking=True) for t in host)
        return self._rows

    def start_ahead(self, tokens: DeferredTokens) -> None:
        """The step whose tokens these are has been sampled on the device: fill the masks of the next step in the
        worker thread, as soon as the tokens reach the host. The worker holds the matchers weakly until it runs: a
        sequence aborted or finished meanwhile lets its matcher go. With mask processes a steady step's tokens go to
        them straight from the device (hand_over_from_device); any other step's, once the engine thread has read
        them (tokens_read)."""
        first = next((seq.grammar for seq in tokens.seqs if seq.grammar is not None), None)
        if first is None:
            return
        if first.pool is not None:
            started = time.perf_counter()
            steady = self._steady
            from_device = (self.hand_over_from_device and self._steady_goes_on(steady, tokens)
                           and steady.pool.takes_from_device(tokens.num_rows))
            if from_device and self._waited:  # handed over once the round trip the GPU waits for is collected
                steady.pool.stage_device_tokens(tokens.device_ids, self._half)
                self._to_send, self._staged = tokens, True
            elif not (from_device and self._in_processes is None and self._send_steady(steady, tokens, None)):
                self._to_send = tokens
            self.seconds += time.perf_counter() - started
            self.send_seconds += time.perf_counter() - started
            return
        items = [(row, weakref.ref(seq.grammar)) for row, seq in enumerate(tokens.seqs) if seq.grammar is not None]
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="tollgate-masks")
        words = self._new_words(len(items), first.mask_words)
        self._ahead = self._worker.submit(self._fill_ahead, tokens, items, words)

    def forward_launched(self) -> None:
        """The engine has launched its next forward pass (or had none to launch) and is about to wait for the
        device: a round trip the GPU waits for is collected (a process that died is started again and fills its
        rows, or the device would wait for ever), and tokens staged by start_ahead are handed over."""
        if self._to_send is not None and self._staged:
            self._send_ahead()
        elif self._waited:
            self._collect()

    def awaits(self, tokens: DeferredTokens) -> bool:
        """Whether mask processes wait for these tokens (tokens_read would send them)."""
        return self._to_send is tokens

    def tokens_read(self, tokens: DeferredTokens, early: bool = False) -> None:
        """These tokens are on the host (read, or their copy done): with mask processes, each matcher of the step
        consumes its token and fills the next step's mask there, while the engine thread goes on (for_step collects
        them). Only the first call for a step's tokens sends them. `early`: found there before the engine read
        them (counted: the processes then have more of the host's step)."""
        if self._to_send is tokens:
            self._send_ahead()
            self.hand_overs_early += early

    def _send_ahead(self) -> None:
        """Sends the tokens start_ahead kept to the mask processes. A sequence whose matcher is behind its tokens
        (its process was started again) is left to for_step."""
        started = time.perf_counter()
        tokens, self._to_send = self._to_send, None
        staged, self._staged = self._staged, False
        collected = self.collect_seconds
        if self._in_processes is not None:  # the round trip the GPU waited for
            self._collect()
        steady = self._steady
        if not (staged and self._steady_goes_on(steady, tokens) and self._send_steady(steady, tokens, None, True)):
            values = tokens.tolist()
            if not (self._steady_goes_on(steady, tokens) and self._send_steady(steady, tokens, values)):
                self._send_planned(tokens, values)
        sending = time.perf_counter() - started - (self.collect_seconds - collected)  # _collect counted its own
        self.seconds += sending
        self.send_seconds += sending

    @staticmethod
    def _steady_goes_on(steady: _Steady | None, tokens: DeferredTokens) -> bool:
        """Whether these tokens' step is steady: the same batch as the last hand-over's, its masks all served."""
        return (steady is not None and steady.served and steady.pool.unchanged()
                and steady.same_batch(tokens.seqs))

    def _send_steady(self, steady: _Steady, tokens: DeferredTokens, values: list[int] | None,
                     staged: bool = False) -> bool:
        """The hand-over of a steady step: the processes run their plans on the new tokens (`values`: as read on
        the host; None: copied there from the device, `staged`: that copy already queued). False (nothing sent) if
        a grammar went meanwhile."""
        grammars = [ref() for ref in steady.ahead.grammars]
        if None in grammars:
            return False
        for grammar in grammars:
            grammar.num_consumed += 1
        half, self._half = self._half, 1 - self._half
        if values is None:
            steady.pool.send_steady_from_device(tokens.device_ids, half, staged)
            self.hand_overs_from_device += 1
        else:
            steady.pool.send_steady([values[row] for row in steady.rows], half)
        words = steady.words.get(half)
        if words is None:
            words = steady.words[half] = steady.pool.buffer(half)[: len(steady.rows)]
        steady.ahead = _Ahead(steady.ahead.grammars, [g.num_consumed for g in grammars], words, half)
        steady.served, steady.checked = False, None
        sent = tokens if values is None else values
        self._in_processes = (steady.pool, steady.ahead, (tokens.seqs, steady.rows, sent))
        return True

    def _send_planned(self, tokens: DeferredTokens, values: list[int]) -> None:
        """The hand-over of any step: each sequence whose matcher has read all but this token is sent it, in new
        plans where the sequences or their rows changed. Sets the steady state where every constrained row went."""
        self._steady = None
        seqs = tokens.seqs
        live, constrained = [], 0
        for row, seq in enumerate(seqs):
            grammar = seq.grammar
            if grammar is not None:
                constrained += 1
                if grammar.num_consumed == _tokens_before_pending(seq):
                    live.append((row, grammar))
        if not live:
            return
        pool = live[0][1].pool
        half, self._half = self._half, 1 - self._half
        grammars = [grammar for _, grammar in live]
        for grammar in grammars:
            grammar.num_consumed += 1
        rows = [row for row, _ in live]
        pool.send_ahead(grammars, [values[row] for row in rows], half, rows)
        ahead = _Ahead([weakref.ref(g) for g in grammars], [g.num_consumed for g in grammars],
                       pool.buffer(half)[: len(live)], half)
        self._in_processes = (pool, ahead, (seqs, rows, values))
        if len(live) == constrained:
            self._steady = _Steady(pool, [weakref.ref(seq) for seq in seqs], rows, ahead)

    def wait(self) -> None:
        """Returns once the worker has no job (a finished batch's last job holds its matchers while it runs)."""
        if self._ahead is not None:
            self._ahead.result()
        self._collect()

    def _collect(self) -> _Ahead | None:
        """The masks the mask processes filled ahead (waiting for them); their refusals booked."""
        in_processes, self._in_processes = self._in_processes, None
        waited, self._waited = self._waited, False
        if in_processes is None:
            return None
        pool, ahead, (seqs, rows, values) = in_processes
        started = time.perf_counter()
        try:
            results, restarted = pool.receive()  # a restarted process's grammars are reset: for_step catches them up
            if restarted and waited:
                self._refill_waited(pool, ahead, seqs, rows, restarted)
        except BaseException:
            if waited:  # the GPU must not wait for ever on processes this could not collect
                pool.release_device_waits()
            raise
        if results or restarted:
            self._steady = None
        if results:
            if isinstance(values, DeferredTokens):  # sent from the device: read only to name a refused token
                values = values.tolist()
            sent = {id(seq.grammar): (seq, values[row]) for row in rows if (seq := seqs[row]).grammar is not None}
            for grammar, _accepted, error in results:  # each refused the one token it was sent
                if id(grammar) in sent:  # else its sequence has finished meanwhile
                    seq, token = sent[id(grammar)]
                    grammar.refused(seq, token, error or "")
        self.seconds += time.perf_counter() - started
        self.collect_seconds += time.perf_counter() - started
        return ahead

    def _refill_waited(self, pool: MaskProcesses, ahead: _Ahead, seqs: list[Sequence], rows: list[int],
                       restarted: set[int]) -> None:
        """Processes died with the GPU waiting for their masks: each one's successor catches up the sequences it
        held and fills their rows of the same half, in the very step the GPU waits for."""
        for _attempt in range(3):
            consume, fill = [], []
            for i, ref in enumerate(ahead.grammars):
                grammar = ref()
                if grammar is None or grammar.worker not in restarted or seqs[rows[i]].grammar is not grammar:
                    continue  # the sequence has finished: its row is sampled but not used
                new = grammar.new_tokens(seqs[rows[i]])
                grammar.num_consumed += len(new)
                consume.append((seqs[rows[i]], new))
                fill.append((grammar, i))
            pool.send([(seq.grammar, new) for seq, new in consume if new], fill, ahead.half, also=restarted)
            results, restarted = pool.receive()
            replies = {id(grammar): (accepted, error) for grammar, accepted, error in results}
            for seq, new in consume:
                if id(seq.grammar) in replies:
                    accepted, error = replies[id(seq.grammar)]
                    seq.grammar.refused(seq, new[accepted], error or "")
            if not restarted:
                return
        raise RuntimeError("structured outputs: the mask processes keep exiting")

    def _assemble_in_processes(self, pool: MaskProcesses, seqs: list[Sequence],
                               ahead: _Ahead | None) -> tuple[torch.Tensor, int]:
        """As _assemble, with the matchers in mask processes: the rows filled ahead that are still current are
        copied, the others caught up and filled in one round trip (again if a process had to be started again)."""
        words, fresh = self._copy_current(seqs, ahead)
        num_ahead = len(seqs) - len(fresh)
        for _attempt in range(3):  # a process started again resets its matchers: they are caught up next time
            if not fresh:
                break
            half = self._half  # the half the next round trip ahead fills: nothing reads it on the device now
            consume = []
            for i in fresh:
                new = seqs[i].grammar.new_tokens(seqs[i])
                if new:
                    consume.append((seqs[i], new))
                    seqs[i].grammar.num_consumed += len(new)
            pool.send([(seq.grammar, new) for seq, new in consume],
                      [(seqs[i].grammar, row) for row, i in enumerate(fresh)], half)
            results, restarted = pool.receive()
            replies = {id(grammar): (accepted, error) for grammar, accepted, error in results}
            for seq, new in consume:
                accepted, error = replies.get(id(seq.grammar), (len(new), None))
                if accepted < len(new):
                    seq.grammar.refused(seq, new[accepted], error or "")
            buffer = pool.buffer(half)
            for row, i in enumerate(fresh):
                if seqs[i].grammar.worker not in restarted:
                    words[i] = buffer[row]
            fresh = [i for i in fresh if seqs[i].grammar.worker in restarted]
        if fresh:
            raise RuntimeError("structured outputs: the mask processes keep exiting")
        return words, num_ahead

    def _take_ahead(self) -> _Ahead | None:
        """The worker's masks (waiting for them); after this call only the engine thread touches the matchers."""
        if self._in_processes is not None:
            return self._collect()
        future, self._ahead = self._ahead, None
        if future is None:
            return None
        started = time.perf_counter()
        ahead = future.result()
        self.seconds += time.perf_counter() - started
        return ahead

    def _fill_ahead(self, tokens: DeferredTokens, items: list[tuple[int, weakref.ref[SequenceGrammar]]],
                    words: torch.Tensor) -> _Ahead | None:
        """In the worker: words (a row per item) gets the masks of the items' grammars still alive, in order."""
        values = tokens.tolist()  # waits for the device
        started = time.perf_counter()
        live = [(row, grammar) for row, ref in items if (grammar := ref()) is not None]
        if not live:
            return None
        accepted = self._consume([(g.matcher, values[row]) for row, g in live])
        for (row, grammar), ok in zip(live, accepted):
            grammar.consumed(tokens.seqs[row], values[row], ok)
        words = words[: len(live)]
        self._fill(words, [(g.matcher, i) for i, (_, g) in enumerate(live)])
        self.ahead_seconds += time.perf_counter() - started
        return _Ahead([weakref.ref(g) for _, g in live], [g.num_consumed for _, g in live], words)

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Each matcher consumes its sequence's tokens read since its last mask: one token each, in parallel, in
        the usual case; any longer run one token at a time."""
        singles = []
        for seq in seqs:
            new = seq.grammar.new_tokens(seq)
            if len(new) == 1:
                singles.append((seq, new[0]))
            elif new:
                seq.grammar.consume(seq, new)
        if singles:
            accepted = self._consume([(seq.grammar.matcher, token) for seq, token in singles])
            for (seq, token), ok in zip(singles, accepted):
                seq.grammar.consumed(seq, token, ok)

    def _consume(self, pairs: list[tuple[object, int]]) -> list[bool]:
        """Each matcher consumes its token, in parallel (llguidance releases the GIL)."""
        started = time.perf_counter()
        accepted = self.executor.consume_token_par(pairs)
        self.native_seconds += time.perf_counter() - started
        return accepted

    def _fill(self, words: torch.Tensor, targets: list[tuple[object, int]]) -> None:
        """Each matcher's mask into its row of words (contiguous), in parallel (llguidance releases the GIL)."""
        started = time.perf_counter()
        row_bytes = words.shape[1] * words.element_size()
        self.executor.unsafe_compute_mask_ptr(targets, words.data_ptr(), row_bytes, words.shape[0])
        self.native_seconds += time.perf_counter() - started
