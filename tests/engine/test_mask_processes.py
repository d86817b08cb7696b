"""Structured outputs' matchers held by mask processes (engine/mask_processes.py): each step's masks, filled there
ahead of the step or caught up when the step needs them, are the masks a matcher of the same grammar computes in
this process after the same tokens; a mask process killed mid-generation is started again and its sequences' masks
come out the same."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

import kernels
from engine.deferred_tokens import DeferredTokens
from engine.grammar import GrammarCompiler
from engine.mask_worker import NO_TOKEN, RUN_PLAN_ON_DEVICE_TOKENS
from engine.config import SamplingParams
from engine.sequence import Sequence
from engine.token_mask import TokenMasker
from tests.engine.helpers import smollm2_tokenizer, write_byte_level_tokenizer
from tests.engine.test_token_mask import SPECS, allowed, new_sequences


@pytest.fixture(params=[0.0, 5.0], ids=["sleeping-workers", "spinning-workers"])
def grammars(request):
    """Workers that sleep on their sockets between steps (each step wakes them) or spin (a steady step reaches
    them through shared memory alone)."""
    tokenizer = smollm2_tokenizer()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, lexers=1, processes=2,
                               max_rows=24, spin_s=request.param)
    yield compiler
    compiler.close()


def mirrors(grammars: GrammarCompiler, seqs) -> dict[str, object]:
    """A matcher of each sequence's grammar in this process, to hold the masks against."""
    return {seq.request_id: grammars.compile(SPECS[i % len(SPECS)]).templates[0].deep_copy()
            for i, seq in enumerate(seqs)}


def own_mask(matcher) -> torch.Tensor:
    return torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)


def check_and_draw(live, mask, local, rng: random.Random) -> list[int]:
    """Checks each constrained row against its mirror's mask; a token per sequence (free ones any token)."""
    constrained = [(i, seq) for i, seq in enumerate(live) if seq.grammar is not None]
    assert mask.rows.tolist() == [i for i, _ in constrained]
    tokens = [rng.randrange(1, 1000) for _ in live]
    for (i, seq), row in zip(constrained, mask.words):
        expected = own_mask(local[seq.request_id])
        assert torch.equal(row, expected[: row.numel()]), seq.request_id
        tokens[i] = rng.choice(allowed(row))
    return tokens


def read_tokens(masker: TokenMasker, tokens: DeferredTokens, local: dict[str, object]) -> None:
    """The engine's order once a step's tokens reach the host: read, handed to the masker, appended to their
    sequences; each constrained sequence's mirror consumes its token."""
    tokens.mark_pending()
    sampled = tokens.read()
    masker.tokens_read(tokens)
    for item in sampled:
        item.seq.token_ids.append(item.token_id)
        if item.seq.grammar is not None:
            assert local[item.seq.request_id].consume_token(item.token_id)


def run_async_steps(grammars: GrammarCompiler, steps: int, kill_at: int | None = None, drop_at: int = 12,
                    free_between: bool = False, from_device: bool = True):
    """The engine's order with async scheduling: masks for the step, its tokens sampled, read a step later, sent to
    the mask processes, appended to the sequences. `free_between`: an unconstrained sequence before each
    constrained one (a sequence's row in the batch is then not its row in the masks)."""
    rng = random.Random(7)
    seqs = new_sequences(grammars)
    local = mirrors(grammars, seqs)
    if free_between:
        seqs = [s for seq in seqs for s in (Sequence(f"free-{seq.request_id}", 0, [1, 2, 3], SamplingParams(), 0, 0.0,
                                                     None, torch.device("cpu")), seq)]
    masker = TokenMasker(torch.device("cpu"), threads=1)
    masker.hand_over_from_device = from_device
    pids = []
    for step in range(steps):
        if step == drop_at:
            seqs = seqs[1:]  # a sequence leaves: the next step assembles its rows
        if step == kill_at:
            pids = [w.process.pid for w in grammars.pool._workers]
            os.kill(pids[0], signal.SIGKILL)
            grammars.pool._workers[0].process.wait()
        live = [seq for seq in seqs if seq.grammar is None or not local[seq.request_id].is_stopped()]
        if all(seq.grammar is None for seq in live):
            break
        mask = masker.for_step(live)
        tokens = DeferredTokens(torch.tensor(check_and_draw(live, mask, local, rng)), live)
        masker.start_ahead(tokens)
        read_tokens(masker, tokens, local)
    masker.wait()
    return masker, pids


def test_masks_from_mask_processes_equal_each_matchers_own(grammars: GrammarCompiler) -> None:
    masker, _ = run_async_steps(grammars, 25)
    assert masker.rows > 100 and masker.rows_ahead > masker.rows // 2
    assert masker.steps_steady >= 15  # every step but those after a change (the start, the drop, a stop)
    assert masker.hand_overs_from_device >= 15  # the steady steps' tokens went from the "device" tensor
    messages = sum(w.messages for w in grammars.pool._workers)
    if grammars.spin_s:  # only the steps where sequences came, left or moved rows sent one
        assert messages <= 2 * 10
    else:
        assert messages >= 2 * 20


@pytest.mark.parametrize("from_device", [True, False], ids=["from-device", "through-engine-thread"])
def test_masks_of_constrained_rows_between_free_ones_equal_each_matchers_own(grammars: GrammarCompiler,
                                                                             from_device: bool) -> None:
    """A constrained sequence's token is at its batch row, its mask at its row among the constrained: the
    processes read the one and write the other, whichever way the tokens reach them."""
    masker, _ = run_async_steps(grammars, 25, free_between=True, from_device=from_device)
    assert masker.steps_steady >= 15
    assert (masker.hand_overs_from_device >= 15) if from_device else masker.hand_overs_from_device == 0


def test_mask_processes_waiting_for_the_devices_tokens_stop_when_closed(grammars: GrammarCompiler) -> None:
    """A steady step handed over whose tokens never land (the engine stops first) does not hold a process up."""
    seqs = new_sequences(grammars)
    masker = TokenMasker(torch.device("cpu"), threads=1)
    mask = masker.for_step(seqs)
    tokens = DeferredTokens(torch.tensor([allowed(row)[0] for row in mask.words]), seqs)
    masker.start_ahead(tokens)
    masker.tokens_read(tokens)  # the first hand-over: a plan per process
    masker.wait()
    pool = grammars.pool
    pool._device_tokens[0].fill_(NO_TOKEN)
    pool._run_plans(0, RUN_PLAN_ON_DEVICE_TOKENS)  # tokens that will never come
    workers = list(pool._workers)
    grammars.close()
    assert [w.process.returncode for w in workers] == [0, 0]  # each left on "stop", none killed after 5 s


def test_a_killed_mask_process_is_started_again_and_its_sequences_caught_up(grammars: GrammarCompiler) -> None:
    masker, pids = run_async_steps(grammars, 20, kill_at=8)
    assert grammars.pool._workers[0].process.pid != pids[0]  # started again
    assert grammars.pool._workers[1].process.pid == pids[1]
    assert masker.rows_ahead > masker.rows // 2


def test_masks_filled_when_the_step_needs_them_equal_each_matchers_own(grammars: GrammarCompiler) -> None:
    """Synchronous scheduling: no round trip ahead, each step catches its matchers up and fills in one."""
    rng = random.Random(3)
    seqs = new_sequences(grammars)
    local = mirrors(grammars, seqs)
    masker = TokenMasker(torch.device("cpu"), threads=1)
    for _ in range(15):
        live = [seq for seq in seqs if not local[seq.request_id].is_stopped()]
        mask = masker.for_step(live)
        for seq, token in zip(live, check_and_draw(live, mask, local, rng)):
            seq.token_ids.append(token)
            assert local[seq.request_id].consume_token(token)
    assert masker.rows_ahead == 0 and masker.rows > 100


def test_finished_sequences_leave_their_mask_process(grammars: GrammarCompiler) -> None:
    import gc

    seqs = new_sequences(grammars)
    masker = TokenMasker(torch.device("cpu"), threads=1)
    masker.for_step(seqs)
    workers = grammars.pool._workers
    assert [w.live for w in workers] == [5, 5]  # spread evenly
    del seqs
    gc.collect()
    assert [w.live for w in workers] == [0, 0] and [len(w.dropped) for w in workers] == [5, 5]
    seqs = new_sequences(grammars)
    masker.for_step(seqs)
    assert [w.live for w in workers] == [5, 5] and [len(w.dropped) for w in workers] == [0, 0]  # sent with the step


def test_a_process_dead_in_a_step_the_gpu_waits_for_is_replaced_within_that_step(grammars: GrammarCompiler) -> None:
    """The engine thread's side of the GPU's wait for the masks (on CUDA only: the test below), here on the CPU: a
    steady round trip marked as one the GPU waits for (as for_step marks it on CUDA), whose process was stopped
    before the step came and killed after. Collecting it (forward_launched) starts the process again, and its
    successor fills that very step's rows: its `done` counter reaches the step the GPU waits for, and every row holds
    the mask a matcher in this process computes. The steps after go on as usual."""
    rng = random.Random(5)
    seqs = new_sequences(grammars)
    local = mirrors(grammars, seqs)
    masker = TokenMasker(torch.device("cpu"), threads=1)
    pool = grammars.pool
    stopped = None

    def step(stop_first: bool) -> None:
        nonlocal stopped
        mask = masker.for_step(seqs)
        tokens = DeferredTokens(torch.tensor(check_and_draw(seqs, mask, local, rng)), seqs)
        if stop_first:  # its step of these tokens is handed over next, straight from the "device"
            stopped = pool._workers[0].process
            os.kill(stopped.pid, signal.SIGSTOP)
        masker.start_ahead(tokens)
        read_tokens(masker, tokens, local)

    for i in range(4):
        step(stop_first=i == 3)
    assert masker.steps_steady >= 2 and masker.hand_overs_from_device >= 3
    _, ahead, _ = masker._in_processes
    waited_for = dict(pool._sent)[0]
    masker._waited = True
    os.kill(stopped.pid, signal.SIGKILL)
    stopped.wait()
    masker.forward_launched()
    successor = pool._workers[0]
    assert successor.process.pid != stopped.pid and successor.control.done == waited_for
    by_grammar = {id(seq.grammar): seq for seq in seqs}
    for row, ref in zip(ahead.words, ahead.grammars):
        expected = own_mask(local[by_grammar[id(ref())].request_id])
        assert torch.equal(row, expected[: row.numel()])
    for _ in range(4):
        step(stop_first=False)
    masker.wait()


@pytest.mark.gpu
@pytest.mark.parametrize("kill_at", [None, 6], ids=["steady", "process-killed-while-the-gpu-waits"])
def test_masks_the_gpu_waits_for_equal_each_matchers_own(tmp_path, kill_at: int | None) -> None:
    """On CUDA the GPU itself waits for a steady step's masks (the engine thread collects them after the next
    launch): each step's tokens are sampled on the device from masks that equal a local matcher's. A process killed
    while the GPU waits for its masks is started again and fills them before anything waits for the device: it was
    stopped before its step came (so it cannot have finished it) and killed once the GPU waited."""
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_source(write_byte_level_tokenizer(tmp_path))
    device = torch.device("cuda")
    grammars = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, lexers=1, processes=2,
                               max_rows=24, device=device, spin_s=5.0)
    try:
        seqs = new_sequences(grammars)
        local = mirrors(grammars, seqs)
        masker = TokenMasker(device, threads=1)
        pool = grammars.pool
        generator = torch.Generator(device).manual_seed(3)
        stopped = None
        for step in range(20):
            live = [seq for seq in seqs if not local[seq.request_id].is_stopped()]
            if not live:
                break
            logits = torch.randn(len(live), tokenizer.vocab_size, device=device, generator=generator)
            logits[:, list(tokenizer.eos_token_ids)] = -1e4  # ends only where a grammar must
            # as the engine: nothing after for_step waits for the device (this indexing would) until forward_launched
            waited_before = masker.steps_waited_on_device
            mask = masker.for_step(live, deferred=True)
            tokens = DeferredTokens(kernels.masked_argmax(logits, mask.words, mask.mask_of_row), live)
            masker.start_ahead(tokens)
            if step == kill_at:
                assert masker.steps_waited_on_device == waited_before + 1  # the GPU waits for the stopped process
                os.kill(stopped.pid, signal.SIGKILL)
                stopped.wait()
            if kill_at is not None and step == kill_at - 1:  # stopped before the next step's masks are handed over
                worker = pool._workers[0]
                while worker.control.done != worker.seq:  # once done with this step's (which are collected next)
                    time.sleep(0.001)
                stopped = worker.process
                os.kill(stopped.pid, signal.SIGSTOP)
            masker.forward_launched()  # the engine's next launch: only now may the host wait for the device
            words = mask.words.cpu()
            for row, seq in zip(words, live):
                assert torch.equal(row, own_mask(local[seq.request_id])[: row.numel()]), (step, seq.request_id)
            read_tokens(masker, tokens, local)
        assert masker.steps_waited_on_device >= 10
        if kill_at is not None:
            assert pool._workers[0].process.pid != stopped.pid
        masker.wait()
    finally:
        grammars.close()
