"""The static token-slot buffer that decode graphs captured with LoRA read: a step's slots are staged into it with -1
on the graph's padding rows (whatever an earlier, larger step left there), and the captured model sees them only
while a graph is captured."""

import numpy as np
import torch

from engine.lora.graph_slots import GraphLoRASlots
from engine.lora.projection import LoRAStep


def test_staged_slots_pad_with_no_adapter_and_indices_view_the_buffer():
    step = LoRAStep()
    slots = GraphLoRASlots(step, max_tokens=8, device=torch.device("cpu"))
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
    slots = GraphLoRASlots(step, max_tokens=4, device=torch.device("cpu"))
    with slots.applied(2):
        assert step.indices is not None and step.indices.num_tokens == 2
    assert step.indices is None
