"""Tensor parallelism over NCCL on two GPUs, CUDA graphs included, against one GPU."""

import multiprocessing as mp

import pytest
import torch

from engine.config import EngineConfig
from engine.distributed.workers import free_port
from engine.llm_engine import LLMEngine
from tests.engine.test_hf_parity import run_and_capture_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _run(path: str, tp: int, dtype: str, prompts: dict[str, list[int]], quantization: str | None = None,
         greedy_on_shards: bool = False, fused_norm: bool = True):
    """Outputs and the logits of each step. Logits are gathered only when the ranks do not pick greedy tokens from
    their vocabulary shards, which is off unless asked for (then no logits come back)."""
    engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype=dtype, tensor_parallel_size=tp,
                                    max_num_batched_tokens=64, num_kv_blocks=128, max_num_seqs=8, max_model_len=512,
                                    quantization=quantization, tp_greedy_on_shards=greedy_on_shards,
                                    tp_fused_norm=fused_norm))
    try:
        assert engine.runner.graphs is not None  # decode steps replay graphs that hold the all-reduces
        if tp > 1:  # the decode all-reduces run fused with their norms unless switched off
            assert (engine.workers.tp.fused_norm is None) == (not fused_norm)
        outputs, logits = run_and_capture_logits(engine, prompts, max_tokens=24)
        return outputs, logits
    finally:
        engine.close()


def test_two_gpus_float32_match_one(tiny_llama_dir):
    gen = torch.Generator().manual_seed(5)
    prompts = {str(n): torch.randint(0, 300, (n,), generator=gen).tolist() for n in (3, 40, 71, 17)}
    one_out, one_logits = _run(tiny_llama_dir, 1, "float32", prompts)
    two_out, two_logits = _run(tiny_llama_dir, 2, "float32", prompts)
    for rid in prompts:
        assert two_out[rid].outputs[0].token_ids == one_out[rid].outputs[0].token_ids
        for (_, a), (_, b) in zip(one_logits[rid], two_logits[rid]):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_two_gpus_bfloat16_llama_1b_shape(tmp_path):
    """bf16 sums in a different order on two ranks: logits agree to bf16 accuracy, not bit for bit."""
    gen = torch.Generator().manual_seed(6)
    prompts = {str(n): torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (50, 300)}
    _, one_logits = _run("random:llama-1b", 1, "bfloat16", prompts)
    _, two_logits = _run("random:llama-1b", 2, "bfloat16", prompts)
    for rid in prompts:
        first_one, first_two = one_logits[rid][0][1], two_logits[rid][0][1]
        assert (first_one - first_two).abs().max().item() < 0.05 * first_one.abs().max().item()
        assert first_one.argmax() == first_two.argmax() or torch.topk(first_one, 2).values.diff().abs() < 0.05


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_two_gpus_quantized_llama_1b_shape(quantization):
    """Quantized on the fly under TP = 2, each rank its own shard (a row-parallel shard gets scales of its own), at
    batch-1 decode (the gated and word-decoding GEMVs, int4's with int8 activations, the int8 LM head): two GPUs
    stray from the unquantized logits no further than one GPU does (fp8 alone moves a random model's logits by
    ~20%), step by step while the greedy tokens of all three agree."""
    prompts = {"one": torch.randint(0, 10000, (64,), generator=torch.Generator().manual_seed(7)).tolist()}
    _, exact = _run("random:llama-1b", 1, "bfloat16", prompts)
    _, one = _run("random:llama-1b", 1, "bfloat16", prompts, quantization)
    _, two = _run("random:llama-1b", 2, "bfloat16", prompts, quantization)
    assert len(one["one"]) == len(two["one"]) == 24
    for (_, ref), (_, a), (_, b) in zip(exact["one"], one["one"], two["one"]):
        one_err, two_err = (a - ref).abs().max().item(), (b - ref).abs().max().item()
        assert two_err < 2 * one_err + 0.01 * ref.abs().max().item()
        if not ref.argmax() == a.argmax() == b.argmax():  # the contexts differ from here on
            break


def test_two_gpus_greedy_tokens_picked_on_shards():
    """Greedy tokens picked from the two vocabulary shards (Triton candidates over 16 chunks a shard, exchanged through
    the peer buffers, read by the next step on each GPU) are the tokens of the gathered logits, at the 1B shape (a
    128,256-token vocabulary), through CUDA graphs."""
    gen = torch.Generator().manual_seed(9)
    prompts = {str(n): torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (40, 7, 90)}
    gathered, _ = _run("random:llama-1b", 2, "bfloat16", prompts)
    picked, logits = _run("random:llama-1b", 2, "bfloat16", prompts, greedy_on_shards=True)
    assert not any(logits.values())  # no step gathered logits
    for rid in prompts:
        assert picked[rid].outputs[0].token_ids == gathered[rid].outputs[0].token_ids


def test_two_gpus_fused_and_unfused_all_reduce_agree():
    """The same TP = 2 engine with the all-reduce fused into the norms and with NCCL + add_rms_norm: the same greedy
    tokens, logits within bf16 rounding."""
    prompts = {"one": torch.randint(0, 10000, (40,), generator=torch.Generator().manual_seed(8)).tolist()}
    fused_out, fused = _run("random:llama-1b", 2, "bfloat16", prompts)
    plain_out, plain = _run("random:llama-1b", 2, "bfloat16", prompts, fused_norm=False)
    assert fused_out["one"].outputs[0].token_ids == plain_out["one"].outputs[0].token_ids
    for (_, a), (_, b) in zip(fused["one"], plain["one"]):
        assert (a - b).abs().max().item() <= 0.02 * b.abs().max().item()


def _fused_rank(rank: int, port: int, results) -> None:
    from engine.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
    from engine.distributed.peer_exchange import MAX_ROWS, try_fused_all_reduce_norm
    from kernels import reference

    device = torch.device("cuda", rank)
    tp = init_tensor_parallel(rank, 2, port, device)
    try:
        shard = 64128  # Llama-3's vocabulary in halves
        fused = try_fused_all_reduce_norm(tp, device, 4096, torch.bfloat16, vocab_shard_rows=shard)
        assert fused is not None, "the start-up check failed"
        gen = torch.Generator(device=device).manual_seed(0)
        worst = 0.0

        def expect(partials, residual, weight):
            mine = partials[rank].clone()
            torch.distributed.all_reduce(mine, group=tp.device_group)
            return reference.add_rms_norm(mine, residual, weight, 1e-5)

        for rows in (1, 7, MAX_ROWS, 1, 2, 33, 1, 1):  # eager calls, row counts changing between them
            partials = torch.randn(2, rows, 4096, generator=gen, device=device).bfloat16()
            residual = torch.randn(rows, 4096, generator=gen, device=device).bfloat16()
            weight = torch.randn(4096, generator=gen, device=device).bfloat16()
            out, summed = fused(partials[rank].contiguous(), residual, weight, 1e-5)
            want_out, want_summed = expect(partials, residual, weight)
            assert torch.equal(summed, want_summed), f"rows {rows}: the sum differs from NCCL's"
            worst = max(worst, (out.float() - want_out.float()).abs().max().item())
            # the exchanged argmax between all-reduces, on the same rows' epochs
            logits = torch.randn(rows, 2 * shard, generator=gen, device=device).bfloat16()
            logits[0, [shard + 7, 7]] = 100.0  # a tie across the shards: the lower index
            got = fused.argmax(logits[:, rank * shard: (rank + 1) * shard].contiguous(), rank * shard, shard)
            assert torch.equal(got, logits.float().argmax(dim=-1)) and got[0].item() == 7, f"rows {rows}: argmax"
        # a graph of two chained calls, as a decode step chains them, replayed with new inputs
        partial = torch.zeros(1, 4096, device=device, dtype=torch.bfloat16)
        residual = torch.zeros_like(partial)
        weight = torch.randn(4096, generator=gen, device=device).bfloat16()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h, r = fused(partial, residual, weight, 1e-5)
            h2, r2 = fused(h, r, weight, 1e-5)
        for _ in range(5):
            both = torch.randn(2, 1, 4096, generator=gen, device=device).bfloat16()
            partial.copy_(both[rank])
            residual.copy_(torch.randn(1, 4096, generator=gen, device=device))
            graph.replay()
            want_h, want_r = expect(both, residual, weight)
            assert torch.equal(r, want_r)
            worst = max(worst, (h.float() - want_h.float()).abs().max().item())
            h_all = torch.stack([h, h])  # every rank holds the same h, so the second call sums it twice
            want_h2, want_r2 = expect(h_all, r, weight)
            assert torch.equal(r2, want_r2)
        torch.cuda.synchronize(device)
        assert fused.failed_waits() == 0
        results.put((rank, worst, None))
    except Exception as e:  # reported to the test, not swallowed
        results.put((rank, None, repr(e)))
    finally:
        destroy_tensor_parallel(tp)


def test_fused_all_reduce_norm_across_two_processes():
    """Two ranks in two processes on two GPUs, exchanging through CUDA IPC: every call's sum equals NCCL's bit for
    bit and the norm is within bf16 rounding of the reference, eagerly and replayed in a CUDA graph."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_fused_rank, args=(rank, port, results)) for rank in range(2)]
    for p in procs:
        p.start()
    reports = sorted(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    for rank, worst, error in reports:
        assert error is None, f"rank {rank}: {error}"
        assert worst < 0.07, f"rank {rank}: normed output off by {worst}"
