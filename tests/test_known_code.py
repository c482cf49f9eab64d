"""dp_hf.per_example.known_code: what runs must be what was read.

A rule recognised by its source (learned positions, relative biases, Swin's attention, BEiT's layer scale,
scaled embeddings) is exact for that code only. A wrapper (``functools.wraps``) or a decorator runs other
code around the same source text: such a method is not recognised. transformers' own gradient-checkpointing
wrapper, which calls the layer's forward unchanged (checkpointing is refused under DP), is the one exception.
"""

from __future__ import annotations

import functools

import torch
import transformers as tf
from transformers.models.beit.modeling_beit import BeitLayer
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

from dp_hf.per_example.known_code import function_definition, normalized_source, signature_and_body
from dp_hf.per_example.positions import is_learned_position_embedding


def mixing(forward):
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return out + out.flip(0)  # rows of other examples: not what the source read says

    return wrapper


class WrappedPositions(OPTLearnedPositionalEmbedding):
    forward = mixing(OPTLearnedPositionalEmbedding.forward)


def test_the_known_forward_is_recognised_and_a_wrapped_copy_is_not():
    assert is_learned_position_embedding(OPTLearnedPositionalEmbedding(16, 8))
    wrapped = WrappedPositions(16, 8)
    assert normalized_source(type(wrapped).forward) is None
    assert not is_learned_position_embedding(wrapped)
    # The wrapper does change the output: recognising it would have been wrong.
    mask = torch.ones(2, 3, dtype=torch.long)
    mask[1, 0] = 0
    assert not torch.equal(wrapped(mask), OPTLearnedPositionalEmbedding.forward(wrapped, mask))


def test_a_decorated_function_is_not_read():
    def decorate(function):
        return function

    @decorate
    def forward(self, x):
        return x

    def plain(self, x):
        """A docstring, dropped."""
        return x

    assert function_definition(forward) is None and signature_and_body(forward) is None
    assert signature_and_body(plain) == ("self, x", "return x")


def test_transformers_checkpointing_wrapper_is_read_through():
    forward = BeitLayer.forward
    assert hasattr(forward, "__wrapped__")  # GradientCheckpointingLayer's forward_with_checkpointing
    assert normalized_source(forward) == normalized_source(forward.__wrapped__) is not None
    layer = BeitLayer(tf.BeitConfig(hidden_size=8, num_attention_heads=2, intermediate_size=16))
    assert not layer.gradient_checkpointing  # (DP refuses gradient checkpointing)
