"""hf_engine.HFEngine samples what it samples with its two speed-ups off, the plain sampler (a
growing cache, every row decoded to the end): the same ids from the same generator, the same
log-probs (test_rollout.py checks them against a forward pass); it keeps the conversation's cache
across turns, and decodes only the rows still going."""

import pytest
import torch

from engines import HFEngine, make_engine
from models.tiny import build_model

WHERE = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="needs a CUDA GPU"))]


def tiny_model():
    torch.manual_seed(0)
    return build_model(vocab_size=64, layers=2, hidden=32, heads=2)


@pytest.mark.parametrize("where", WHERE)
def test_the_fast_engine_samples_what_the_plain_one_samples(where):
    """Greedy, tempered and top-p, from a generator on the model's device or the CPU: both engines
    draw each row's token from the same stream (compaction included), so the same seed gives the
    same ids, and their log-probs agree to float rounding (a static cache against a growing one)."""
    model = tiny_model().to(where)
    plain = HFEngine(model, pad_id=0, static_cache=False, compact=False)
    fast = HFEngine(model, pad_id=0)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15], [16, 17, 18, 19]]
    for temperature, top_p in ((0.0, 1.0), (0.7, 1.0), (1.0, 0.9)):
        for gen_device in {torch.device(where), torch.device("cpu")}:
            a, b = (e.generate(prompts, 10, [3, 4, 5], temperature, top_p,
                               torch.Generator(gen_device).manual_seed(11)) for e in (plain, fast))
            assert [(s.ids, s.stopped) for s in a] == [(s.ids, s.stopped) for s in b]
            for s, t in zip(a, b):
                assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(t.logprobs), atol=1e-5)
    assert fast.decoded_rows > 0


def test_make_engine_builds_the_hf_engine_on_the_trainers_model():
    model = torch.nn.Linear(2, 2)
    engine = make_engine("hf", model, "/unused", pad_id=3)
    assert type(engine) is HFEngine and engine.model is model and engine.pad_id == 3
    assert engine.sync_weights(model) == 0.0 and engine._kept is None


def test_the_cache_is_kept_across_turns():
    """reuse=True: each turn encodes only what the previous call did not see, and samples what a
    full encoding samples (greedy ids equal, log-probs to float rounding), with rows finishing in
    between and a new conversation joining. After an in-place weight change nothing is reused."""
    model = tiny_model()
    kept = HFEngine(model, pad_id=0, max_batch=3)  # in chunks of 3: rows kept across chunks
    fresh = HFEngine(model, pad_id=0)
    g = torch.Generator().manual_seed(1)
    rand = lambda n: [int(x) for x in torch.randint(4, 64, (n,), generator=g)]  # noqa: E731
    prompts = [rand(n) for n in (5, 17, 9, 30, 11)]
    encoded = []
    for turn in range(4):
        a = kept.generate(prompts, 6, [3], temperature=0.0, reuse=True)
        b = fresh.generate(prompts, 6, [3], temperature=0.0)
        assert [s.ids for s in a] == [s.ids for s in b]
        for s, t in zip(a, b):
            assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(t.logprobs), atol=1e-5)
        encoded.append(kept.encoded_tokens)
        obs = rand(4)
        prompts = [p + s.ids + obs for p, s in zip(prompts, a)]
        if turn == 1:
            prompts = prompts[1:] + [rand(12)]  # the first conversation ends, a new one starts
    total = sum(len(p) for p in prompts)
    assert kept.reused_tokens > 0
    assert encoded[-1] - encoded[-2] < 0.5 * total  # a turn encodes a fraction of its prompts
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # what an optimizer step does
    before = kept.reused_tokens
    a = kept.generate(prompts, 6, [3], temperature=0.0, reuse=True)
    assert kept.reused_tokens == before  # stale keys and values are not reused
    assert [s.ids for s in a] == [s.ids for s in fresh.generate(prompts, 6, [3], temperature=0.0)]
    kept.forget()
    assert kept._kept is None


def test_only_the_rows_still_going_are_decoded():
    """Once half the rows have stopped, the rest are decoded alone: the same samples and log-probs
    as decoding every row to the end (each row's sampling stream is unchanged), fewer rows computed,
    and the cache kept for the next turn still serves it (three turns with reuse=True)."""
    model = tiny_model()
    compact, plain = HFEngine(model, pad_id=0), HFEngine(model, pad_id=0, compact=False)
    g = torch.Generator().manual_seed(3)
    prompts = [[int(x) for x in torch.randint(10, 64, (n,), generator=g)]
               for n in (4, 9, 13, 6, 21, 8, 5, 11)]
    stops = list(range(1, 10))  # about one token in seven stops a row: rows end at different steps
    stopped_at = []
    for turn in range(3):
        a = compact.generate(prompts, 24, stops, 1.0, generator=torch.Generator().manual_seed(turn),
                             reuse=True)
        b = plain.generate(prompts, 24, stops, 1.0, generator=torch.Generator().manual_seed(turn))
        assert [s.ids for s in a] == [s.ids for s in b]
        for s, t in zip(a, b):
            assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(t.logprobs), atol=1e-5)
        stopped_at.append(sorted(len(s.ids) for s in a))
        prompts = [p + s.ids + [12, 13] for p, s in zip(prompts, a)]
    assert all(x[0] < x[-1] for x in stopped_at)  # rows did stop at different steps
    assert compact.reused_tokens > 0  # the compacted cache was kept and reused
    assert compact.decoded_rows < 0.8 * plain.decoded_rows, (compact.decoded_rows,
                                                             plain.decoded_rows)
