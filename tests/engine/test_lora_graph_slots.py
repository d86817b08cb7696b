"""The static token-slot buffers that decode graphs captured with LoRA read: a step's slots are staged into them with
-1 on the graph's padding rows (whatever an earlier, larger step left there), with its rows grouped by slot for the
grouped kernels, and the captured model sees them only while a graph is captured; which decode form a step takes."""

import numpy as np
import pytest
import torch

from engine.lora.batch import decode_form
from engine.lora.graph_slots import GraphLoRASlots
from engine.lora.projection import LoRAStep


def test_staged_slots_pad_with_no_adapter_and_indices_view_the_buffer():
    step = LoRAStep()
    slots = GraphLoRASlots(step, max_tokens=8, device=torch.device("cpu"), num_slots=4)
    slots.stage(np.array([3, -1, 0, 2, 1, 1], dtype=np.int32), 8)
    slots.stage(np.array([1, -1, 2], dtype=np.int32), 4)
    assert slots.token_slots[:4].tolist() == [1, -1, 2, -1]
    indices = slots.indices(4)
    assert indices.one_token_per_seq and indices.num_tokens == 4 and indices.num_segments == 4
    assert indices.seg_starts.tolist() == [0, 1, 2, 3, 4]
    assert indices.token_slots.data_ptr() == slots.token_slots.data_ptr()  # what a graph captures is the buffer
    slots.stage(None, 2)
    assert slots.token_slots[:2].tolist() == [-1, -1]


def test_the_model_reads_the_buffer_only_while_a_graph_is_captured():
    step = LoRAStep()
    slots = GraphLoRASlots(step, max_tokens=4, device=torch.device("cpu"), num_slots=4)
    with slots.applied(2):
        assert step.indices is not None and step.indices.num_tokens == 2 and not step.indices.grouped
    with slots.applied(2, "grouped"):
        assert step.indices.grouped and not step.indices.dense and step.indices.num_slots == 4
    with slots.applied(2, "dense"):
        assert step.indices.grouped and step.indices.dense
    assert step.indices is None


def test_staged_rows_are_grouped_by_slot_over_the_graphs_rows_padding_with_the_base_model():
    slots = GraphLoRASlots(LoRAStep(), max_tokens=8, device=torch.device("cpu"), num_slots=4)
    slots.stage(np.array([3, -1, 0, 2, 1, 1, 3, 0], dtype=np.int32), 8)
    slots.stage(np.array([2, -1, 2], dtype=np.int32), 4)  # a graph of 4 rows: row 3 is padding
    indices = slots.indices(4, "grouped")
    assert indices.sorted_rows.tolist() == [0, 2, 1, 3]
    assert indices.group_starts.tolist() == [0, 0, 0, 2, 2, 4]  # slots 0..3, the base-model rows, the end
    assert indices.group_starts.data_ptr() == slots.group_starts.data_ptr()
    assert indices.sorted_rows.data_ptr() == slots.sorted_rows.data_ptr()
    with pytest.raises(RuntimeError, match="5 tokens staged into a graph of 4 rows"):
        slots.stage(np.zeros(5, dtype=np.int32), 4)


@pytest.mark.parametrize("slots,kernels,form", [
    ([3], "auto", "bgmv"),  # batch 1: per token
    ([3, 3], "auto", "grouped"),
    ([0, 1, 2, 3, -1, -1], "auto", "bgmv"),  # one token per adapter
    ([0, 0, 1, 1, 2, -1], "auto", "bgmv"),  # 5 adapter tokens over 3 adapters
    ([0, 0, 1, 1, 2, 2, -1], "auto", "grouped"),  # 3 of 8 slots in use
    ([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5], "auto", "dense"),  # 6 of 8 slots: 3/4 of the pool
    ([0, 0, 1, 1, 2, 2, 3, 3, 4, 4], "auto", "grouped"),  # 5 of 8
    ([0, 0, 0, 0], "bgmv", "bgmv"),
    ([3], "grouped", "grouped"),
    ([3], "dense", "dense"),
])
def test_decode_steps_group_by_slot_from_two_tokens_per_adapter_and_go_dense_over_most_slots(slots, kernels, form):
    assert decode_form(np.array(slots, dtype=np.int32), kernels, num_slots=8) == form
    assert decode_form(None, kernels, num_slots=8) == "bgmv"
