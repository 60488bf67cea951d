"""lib.encdec: the encoder-decoder equals Hugging Face's BART on its weights, decodes with the
cross-attention keys and values computed once, and honours both of its masks."""

import pytest
import torch
from refusals import assert_refuses, built, not_float, refusal_test, rows
from transformers import BartConfig, BartForConditionalGeneration

from lib.encdec import EncDecConfig, EncoderDecoder, greedy_decode, greedy_decode_ref
from lib.tasks import reversal_batch, seq2seq_loss
from lib.train import train

V, S, T = 48, 11, 7  # lengths that are multiples of nothing in the model


def _bart(seed=0, **changes):
    torch.manual_seed(seed)
    # init_std 0.3 (BART's is 0.02): random weights large enough that the logits, and so the greedy
    # tokens, depend on the input instead of being one token everywhere
    cfg = dict(
        vocab_size=V,
        d_model=32,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        init_std=0.3,
    )
    hf = BartForConditionalGeneration(BartConfig(**{**cfg, **changes})).eval()
    with torch.no_grad():
        hf.final_logits_bias.normal_(0, 0.1)  # zero in a fresh model: make it count
    return hf


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (3, S), generator=g)
    mask = torch.ones(3, S, dtype=torch.long)
    mask[1, 8:] = 0  # right padding
    mask[2, :2], mask[2, 9:] = 0, 0  # padding on both sides
    src[mask == 0] = 1  # BART's <pad>
    tgt = torch.randint(3, V, (3, T), generator=g)
    return src, mask, tgt


def test_logits_equal_hugging_face_bart():
    hf = _bart()
    ours = EncoderDecoder.from_bart(hf)
    src, mask, tgt = _batch()
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        got = ours(src, tgt, mask)
    assert got.shape == (3, T, V)
    # fp32, the same layers in the same order; attention kernels may sum in another order: ~1e-6
    torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)


def test_scaled_embeddings_load_too():
    hf = _bart(scale_embedding=True)
    src, mask, tgt = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            EncoderDecoder.from_bart(hf)(src, tgt, mask),
            hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits,
            rtol=1e-5,
            atol=1e-5,
        )  # fp32, as above


def test_greedy_decode_equals_the_reference_and_hugging_face_generate():
    hf = _bart(seed=2)
    ours = EncoderDecoder.from_bart(hf)
    src, mask, _ = _batch()
    fast = greedy_decode(ours, src, mask, max_new_tokens=9)
    assert torch.equal(fast, greedy_decode_ref(ours, src, mask, max_new_tokens=9))
    theirs = hf.generate(
        src,
        attention_mask=mask,
        max_new_tokens=9,
        min_length=0,
        num_beams=1,
        do_sample=False,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        no_repeat_ngram_size=0,
        eos_token_id=None,
        pad_token_id=1,
    )
    assert torch.equal(fast, theirs)
    assert len(set(fast[:, 1:].flatten().tolist())) > 2  # the tokens depend on the input: not one token


def test_cross_attention_keys_and_values_are_computed_once_per_source():
    ours = EncoderDecoder.from_bart(_bart())
    src, mask, _ = _batch()
    calls = []
    for layer in ours.decoder.layers:
        layer.encoder_attn.k_proj.register_forward_hook(lambda *a: calls.append(1))
    greedy_decode(ours, src, mask, max_new_tokens=6)
    assert len(calls) == ours.config.decoder_layers  # once per layer, not once per step
    calls.clear()
    greedy_decode_ref(ours, src, mask, max_new_tokens=6)
    assert len(calls) == 6 * ours.config.decoder_layers


def test_source_padding_is_invisible_and_the_decoder_is_causal():
    ours = EncoderDecoder.from_bart(_bart())
    src, mask, tgt = _batch()
    other = src.clone()
    other[mask == 0] = 7  # other tokens under the padding
    with torch.no_grad():
        base = ours(src, tgt, mask)
        assert torch.equal(base, ours(other, tgt, mask))  # a blocked column weighs exactly 0
        assert not torch.equal(base, ours(other, tgt, None))  # without the mask the padding is read
        later = tgt.clone()
        later[:, 4:] = (later[:, 4:] + 1) % V
        changed = ours(src, later, mask)
    assert torch.equal(changed[:, :4], base[:, :4]) and not torch.equal(changed[:, 4:], base[:, 4:])


def test_every_target_position_reads_the_whole_source():
    """Cross-attention is not causal: the first target position reads the encoder's output at
    the last source position (a causal cross mask would hide it)."""
    ours = EncoderDecoder.from_bart(_bart())
    src, _, tgt = _batch()
    with torch.no_grad():
        memory = ours.encode(src)
        moved = memory.clone()
        moved[:, -1] += 1.0  # only the last source position's memory
        first, first_moved = (ours.decode(tgt, ours.cross_kv(m))[:, 0] for m in (memory, moved))
    assert not torch.allclose(first, first_moved)


def test_decoding_step_by_step_with_caches_gives_the_full_forward_logits():
    ours = EncoderDecoder.from_bart(_bart())
    src, mask, tgt = _batch()
    with torch.no_grad():
        full = ours(src, tgt, mask)
        kv = ours.cross_kv(ours.encode(src, mask))
        caches = ours.new_caches(3, T)
        steps = [ours.decode(tgt[:, t : t + 1], kv, mask, caches=caches, start=t) for t in range(T)]
    # fp32: one query row at a time sums the same terms as the full matrix, up to ~1e-7 each
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


# fmt: off
FROM_HUGGINGFACE_REFUSALS = [
    ("hf_config", BartConfig(activation_function="relu"), ValueError,
     "this BART config does not fit EncDecConfig: activation_function='relu' (this model uses exact GELU)"),
    ("hf_config", BartConfig(encoder_attention_heads=4, decoder_attention_heads=2), ValueError,
     "this BART config does not fit EncDecConfig: encoder_attention_heads=4 vs decoder_attention_heads=2"),
]
# fmt: on
test_t5_and_other_bart_variants_are_refused_clearly = refusal_test(
    EncDecConfig.from_huggingface, built(lambda: dict(hf_config=BartConfig())), FROM_HUGGINGFACE_REFUSALS
)


CONFIG_REFUSALS = [
    ("d_model", 30, ValueError, "d_model (30) must be divisible by n_heads (4)"),
    ("pad_token_id", 64, ValueError, "pad_token_id must lie in [0, vocab_size=64), got 64"),
    ("n_heads", 0, ValueError, "n_heads must be >= 1, got 0"),
]
test_config_refusals = refusal_test(EncDecConfig, dict(d_model=32, n_heads=4), CONFIG_REFUSALS)


def _model():
    return EncoderDecoder(EncDecConfig(vocab_size=V, max_position_embeddings=32))


_IDS = torch.zeros(2, 3, dtype=torch.long)
# fmt: off
FORWARD_REFUSALS = [
    ("input_ids", torch.zeros(2, 3), TypeError,
     "input_ids must be an int64 (or int32) tensor of token ids, got torch.float32"),
    ("input_ids", torch.full((2, 3), V), ValueError, "input_ids must lie in [0, vocab_size=48), got min 48, max 48"),
    ("attention_mask", torch.ones(2, 4), ValueError,
     "attention_mask must have input_ids' shape (B, S) = (2, 3), got (2, 4)"),
]
# fmt: on
test_forward_refusals = refusal_test(
    built(_model),
    built(lambda: dict(input_ids=_IDS, decoder_input_ids=torch.zeros(2, 2, dtype=torch.long), attention_mask=None)),
    FORWARD_REFUSALS,
)


DECODE_REFUSALS = [
    ("cross_kv", [], ValueError, "cross_kv must be a list of 2 (k, v) pairs, from cross_kv(memory)"),
    ("start", 2, ValueError, "start=2 needs the caches that hold positions 0..1"),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(DECODE_REFUSALS))
def test_decode_refusals(argument, bad, error, message):
    model = _model()
    good = dict(decoder_input_ids=torch.zeros(1, 2, dtype=torch.long), cross_kv=model.cross_kv(torch.zeros(1, 3, 32)))
    assert_refuses(model.decode, good, argument, bad, error, message)


# fmt: off
CROSS_KV_REFUSALS = [
    ("memory", torch.zeros(1, 3, 16), ValueError, "memory must be the encoder's output (B, S, C=32), got (1, 3, 16)"),
    ("memory", torch.zeros(1, 3, 32, dtype=torch.long), TypeError, not_float("memory")),
]
# fmt: on
test_cross_kv_refusals = refusal_test(
    built(lambda: _model().cross_kv), built(lambda: dict(memory=torch.zeros(1, 3, 32))), CROSS_KV_REFUSALS
)


GREEDY_DECODE_REFUSALS = [
    ("max_new_tokens", 0, ValueError, "max_new_tokens must be >= 1, got 0"),
    ("max_new_tokens", 40, ValueError, "max_new_tokens + 1 = 41 target positions exceed max_position_embeddings=32"),
    ("model", "bart", TypeError, "model must be an EncoderDecoder, got str"),
]
test_greedy_decode_refusals = refusal_test(
    greedy_decode,
    built(lambda: dict(model=_model(), input_ids=torch.zeros(1, 3, dtype=torch.long), max_new_tokens=5)),
    GREEDY_DECODE_REFUSALS,
)


def test_returned_cross_attention_weights_are_the_ones_used():
    ours = EncoderDecoder.from_bart(_bart())
    src, mask, tgt = _batch()
    with torch.no_grad():
        kv = ours.cross_kv(ours.encode(src, mask))
        logits, weights = ours.decode(tgt, kv, mask, return_cross_attentions=True)
        # fp32: the weights path (softmax, then @ v) and the fused kernel differ by ~1e-7
        torch.testing.assert_close(logits, ours.decode(tgt, kv, mask), rtol=1e-5, atol=1e-5)
    assert len(weights) == ours.config.decoder_layers
    for w in weights:
        assert w.shape == (3, 4, T, S)
        torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, T))  # each row a distribution
        assert torch.equal(
            w.masked_select(mask[:, None, None, :].expand_as(w) == 0), torch.zeros(int((mask == 0).sum()) * 4 * T)
        )  # padding columns get exactly 0


def test_a_small_model_learns_to_reverse():
    """Cross-attention at work: the decoder must read the source, position by position backwards."""
    torch.manual_seed(0)
    model = EncoderDecoder(EncDecConfig(vocab_size=16, d_model=32, ffn_dim=64, max_position_embeddings=16))
    train(model, reversal_batch, seq2seq_loss, steps=250, lr=3e-3)
    held_out = reversal_batch(10**6, batch=100)
    out = greedy_decode(model, held_out["input_ids"], held_out["attention_mask"], max_new_tokens=8)[:, 1:]
    right = ((out == held_out["labels"]) | (held_out["labels"] == -100)).all(1)
    assert right.float().mean() > 0.8  # chance is (1/13)^4 or less per row
