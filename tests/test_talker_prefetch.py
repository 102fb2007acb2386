"""Many arrivals tokenized in one batch (``TextTokenizer.warm``, ``TalkerAdmission.prefetch``, the stage's
``_prefetch``): the ids are those of one-by-one encoding, a batch's repeated texts are encoded once, nothing is
kept past a batch, texts the checks refuse are not tokenized ahead of them, and a failing prefetch costs no
request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omniloop.actors.stage import StageActor
from omniloop.errors import RequestError
from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.stage_talker import TalkerAdmission
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint
from omniloop.models.qwen3_tts.tokenizer import TextTokenizer, assistant_text, instruct_text
from omniloop.scheduler.ar import ArConfig, ArScheduler
from omniloop.transport.messages import SpeechRequest, Submit

TEXTS = ["Hello there.", "Grüße aus Köln — 東京 too!", "Hello there.", "  spaces  \n and lines ", "x" * 300]


@pytest.fixture(scope="module")
def layout():
    path = ensure_tiny_checkpoint("voice_design")
    return load_tts_config(path), path


def test_warmed_ids_are_the_one_by_one_ids_and_one_batch_is_kept(layout) -> None:
    cfg, path = layout
    plain, warmed = TextTokenizer.from_dir(path), TextTokenizer.from_dir(path)
    want = {t: plain.encode(assistant_text(t)).tolist() for t in TEXTS}
    warmed.warm([assistant_text(t) for t in TEXTS])
    assert len(warmed._warm) == len(set(TEXTS))  # duplicates encoded once
    encoded = []
    warmed.tok = _Counting(warmed.tok, encoded)
    for t in TEXTS:  # the repeated text too: "Hello there." twice
        assert warmed.encode(assistant_text(t)).tolist() == want[t]
    assert encoded == []  # every text of the batch, repeats included, came from the batch
    assert len(warmed._warm) == len(set(TEXTS))  # kept until the next batch
    warmed.encode("not warmed")
    assert encoded == ["not warmed"]
    warmed.tok = warmed.tok.inner
    warmed.start_threads()
    assert not warmed._warm  # the pool started, nothing kept
    warmed.warm(["left over"])
    warmed.warm([assistant_text("next")])
    assert list(warmed._warm) == [assistant_text("next")]  # the earlier batch's leftover is gone
    assert warmed.encode("not warmed").tolist() == plain.encode("not warmed").tolist()


def test_prefetched_admission_equals_the_plain_one_and_checks_still_refuse(layout) -> None:
    cfg, path = layout

    def admission(tok: TextTokenizer) -> TalkerAdmission:
        return TalkerAdmission(cfg, tok, voice=None, max_model_len=4096, max_text_chars=100, max_ref_seconds=30)

    reqs = [SpeechRequest(text=t, instructions=f"speak {i}") for i, t in enumerate(TEXTS[:4])]
    too_long = SpeechRequest(text=TEXTS[4], instructions="calm")
    submits = [Submit(f"r{i}", r) for i, r in enumerate([*reqs, too_long])]
    plain, warmed_tok = TextTokenizer.from_dir(path), TextTokenizer.from_dir(path)
    warmed = admission(warmed_tok)
    warmed.prefetch(submits)
    assert assistant_text(TEXTS[4]) not in warmed_tok._warm  # over max_text_chars: left to the check
    assert instruct_text("speak 2") in warmed_tok._warm
    for submit in submits[:4]:
        got = warmed(submit.req_id, submit, {}).payload.base
        want = admission(plain)(submit.req_id, submit, {}).payload.base
        assert got.input_ids.tolist() == want.input_ids.tolist()
        assert got.instruct_ids.tolist() == want.instruct_ids.tolist()
    with pytest.raises(RequestError, match="100"):
        warmed(submits[4].req_id, submits[4], {})


class _Counting:
    """A tokenizer that records the texts encoded one by one."""

    def __init__(self, inner, log: list[str]) -> None:
        self.inner, self.log = inner, log

    def encode(self, text: str, **kwargs):
        self.log.append(text)
        return self.inner.encode(text, **kwargs)


class _Prepare:
    def __init__(self, fail: bool) -> None:
        self.fail, self.prefetched = fail, []

    def prefetch(self, submits: list[Submit]) -> None:
        if self.fail:
            raise RuntimeError("prefetch broke")
        self.prefetched.append([s.req_id for s in submits])

    def __call__(self, req_id, submit, arrays):
        from omniloop.scheduler.request import ArPrompt
        return ArPrompt(num_prompt_tokens=4, max_frames=3)


@pytest.mark.parametrize("fail", [False, True])
def test_the_stage_prefetches_arrival_batches_and_a_failure_loses_no_request(fail: bool) -> None:
    prepare = _Prepare(fail)
    scheduler = ArScheduler(ArConfig(stage="talker", max_num_seqs=4, max_num_tokens=64, num_kv_blocks=16,
                                     block_size=16), prepare)
    stage = SimpleNamespace(scheduler=scheduler, stage=SimpleNamespace(name="talker"))
    batch = [(Submit(f"r{i}", SpeechRequest(text="hi")), {}) for i in range(3)]
    StageActor._prefetch(stage, batch)
    StageActor._prefetch(stage, batch[:1])  # one arrival: nothing to batch
    assert prepare.prefetched == ([] if fail else [["r0", "r1", "r2"]])
    for submit, arrays in batch:
        scheduler.add(submit.req_id, submit, arrays)
    plan = scheduler.schedule()
    assert plan is not None and sorted(seq.req_id for seq in plan.seqs) == ["r0", "r1", "r2"]
