"""Review 2: a request whose slot cannot be set up in the runner (its admission fails inside the step,
e.g. the voice encoder raising on its reference audio) must end alone, with an error. Before, the
exception failed the whole step, so every other request in it ended with that request's error, and the
step already in flight behind it (async overlap) failed too: its next chunked-prefill piece found no
prompt in the slot, failing the requests of that step as well."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from omniloop.gpu.talker_runner import TalkerRunner
from omniloop.models.qwen3_tts.prompt import Prompt, TtsInput, build_prompt
from omniloop.scheduler.ar import ArConfig, ArScheduler
from omniloop.scheduler.request import ArPrompt
from omniloop.transport.messages import Chunk, Finish

from tests.test_talker_runner import _input, _model


@dataclass
class Payload:
    inputs: TtsInput
    prompt: Prompt | None = None


class BrokenPayload:
    """Like stage_talker's payload whose lazy ``inputs`` runs the voice encoder, which raises."""

    prompt = None

    @property
    def inputs(self) -> TtsInput:
        raise RuntimeError("speaker encoder failed on this reference audio")


def _endings(emits, endings: dict[str, str]) -> None:
    for emit in emits:
        msg = emit.msg if hasattr(emit, "msg") else emit[1]
        if isinstance(msg, Finish):
            endings.setdefault(msg.req_id, msg.reason)
        elif isinstance(msg, Chunk) and msg.final:
            endings.setdefault(msg.req_id, msg.reason)


def test_a_failed_admission_ends_only_its_own_request() -> None:
    model, _ = _model()
    good = _input("A request that is already decoding.", frames=12)
    late = _input("A request admitted beside the broken one.", frames=6)
    n_good = build_prompt(model, good).embeds.shape[0]
    n_late = build_prompt(model, late).embeds.shape[0]

    async def drive() -> dict[str, str]:
        runner = TalkerRunner(model, device="cpu", max_num_seqs=4, max_len=128, use_cuda_graphs=False)
        sched = ArScheduler(ArConfig(max_num_seqs=4, max_num_tokens=24, num_kv_blocks=64, block_size=16))
        endings: dict[str, str] = {}
        pending: list = []
        sched.add("good", ArPrompt(num_prompt_tokens=n_good, max_frames=12, priority=-1, payload=Payload(good)))
        num_steps = 0
        try:
            while sched.num_requests or pending:
                while len(pending) < 2 and (plan := sched.schedule()) is not None:
                    pending.append((plan, runner.submit(plan)))
                    num_steps += 1
                    if num_steps == 4:  # "good" decodes by now; the broken prompt takes 2 steps, "late" starts in its 2nd
                        sched.add("bad", ArPrompt(num_prompt_tokens=40, max_frames=4, payload=BrokenPayload()))
                        sched.add("late", ArPrompt(num_prompt_tokens=n_late, max_frames=6, payload=Payload(late)))
                plan, future = pending.pop(0)
                try:
                    emits = sched.update(plan, await future)
                except Exception as exc:  # noqa: BLE001 - what the stage actor does
                    emits = sched.fail(plan, exc)
                _endings(emits, endings)
        finally:
            runner.close()
        return endings

    endings = asyncio.run(drive())
    assert endings == {"good": "length", "bad": "error", "late": "length"}
