"""Every message that crosses a socket, in one module.

A message travels as multipart frames: ``[kind byte][msgspec header][buffer 0][buffer 1]...``.
The kind byte lets a router forward without decoding; arrays (codes, PCM, hidden states) never go
through msgspec but ride as out-of-band buffers described by a ``TensorMeta`` in the header.
See ``omniloop.transport.frames`` for the encoder/decoder.
"""

from __future__ import annotations

import enum

import msgspec


class Kind(enum.IntEnum):
    SUBMIT = 1
    CHUNK = 2
    ABORT = 3
    FINISH = 4
    READY = 5
    STATS = 6
    SHUTDOWN = 7
    CREDIT = 8
    CHUNKS = 9


class Reason(str, enum.Enum):
    """Why a request ended. Travels in ``Chunk.reason`` (final chunk) and ``Finish.reason``."""

    STOP = "stop"  # EOS reached
    LENGTH = "length"  # max frames/tokens reached without EOS; audio is complete up to there
    ABORT = "abort"  # client went away or asked to abort
    ERROR = "error"  # request-scoped failure; Finish.error says what
    CODEC_LIMIT = "codec_limit"  # configured hard codec frame limit reached
    STAGE_DIED = "stage_died"  # an actor holding the request died
    SHUTDOWN = "shutdown"  # server stopped before the request finished


class TensorMeta(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Describes one out-of-band buffer: numpy dtype string, shape, index among the buffers."""

    dtype: str
    shape: tuple[int, ...]
    index: int


class Sampling(msgspec.Struct, omit_defaults=True, frozen=True, forbid_unknown_fields=True):
    """Per-request sampling. ``None`` means: the checkpoint's generation_config / profile default."""

    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    # code predictor ("sub-talker") sampling, separate as in the reference
    sub_do_sample: bool | None = None
    sub_temperature: float | None = None
    sub_top_k: int | None = None
    sub_top_p: float | None = None
    seed: int | None = None


class SpeechRequest(msgspec.Struct, tag="speech", omit_defaults=True, frozen=True, forbid_unknown_fields=True):
    """A text-to-speech request (Qwen3-TTS). Field names follow the HTTP API."""

    text: str
    task: str | None = None  # custom_voice | voice_design | base; None = the checkpoint's type
    speaker: str | None = None
    language: str | None = None  # None/"auto" = auto
    instructions: str | None = None
    ref_audio: bytes | None = None  # an encoded audio file (wav/flac/ogg...), decoded by the frontend
    ref_text: str | None = None
    x_vector_only: bool = False
    sampling: Sampling = Sampling()
    max_frames: int | None = None
    initial_chunk_frames: int | None = None  # first codec chunk size, frames
    return_codes: bool = False  # also stream the generated codes (int64 [n,16]) beside the PCM


class ChatRequest(msgspec.Struct, tag="chat", omit_defaults=True, frozen=True, forbid_unknown_fields=True):
    """A chat request for thinker models (Qwen3-Omni): OpenAI-style messages as plain data."""

    messages: list[dict]
    speaker: str | None = None
    want_audio: bool = True
    max_tokens: int | None = None
    sampling: Sampling = Sampling()


class Submit(msgspec.Struct, tag="submit", omit_defaults=True, gc=False):
    """A new request entering the first stage. ``arrays`` may carry decoded reference audio
    (``ref_pcm``: float32 mono 24 kHz) prepared by the frontend."""

    req_id: str
    request: SpeechRequest | ChatRequest
    arrival: float = 0.0  # time.time() at the frontend
    arrays: dict[str, TensorMeta] = {}
    pcm_dtype: str = "float32"  # PCM sample format the client wants back: "float32" | "int16"


class Chunk(msgspec.Struct, tag="chunk", omit_defaults=True, gc=False):
    """A piece of a request's output flowing downstream. ``arrays`` name the buffers
    (e.g. ``codes`` int64 [n,16], ``pcm`` float32 [n], ``hidden``); ``text`` is a text delta.
    The final chunk of a stage carries ``final=True`` and the ``reason`` the stream ended."""

    req_id: str
    seq: int
    final: bool = False
    reason: str | None = None
    text: str | None = None
    arrays: dict[str, TensorMeta] = {}
    stage: str = ""


class Chunks(msgspec.Struct, tag="chunks", omit_defaults=True, gc=False):
    """Many requests' plain chunks (not final, no text) of one step, between stages, in one message: a
    talker step at 64 streams would otherwise send 64 messages (~33 us of loop-thread time each, send and
    receive). ``arrays`` hold the chunks' arrays concatenated along axis 0; chunk i owns ``rows[i]`` rows of
    each (see ``transport.batching``)."""

    req_ids: list[str]
    seqs: list[int]
    rows: list[int]
    arrays: dict[str, TensorMeta] = {}
    stage: str = ""


class Abort(msgspec.Struct, tag="abort", omit_defaults=True, gc=False):
    req_id: str
    reason: str = Reason.ABORT.value


class Finish(msgspec.Struct, tag="finish", omit_defaults=True, gc=False):
    """The one terminal message of a request. ``error`` is a human-readable message for
    ``reason`` in (error, codec_limit, stage_died, shutdown); ``stage`` names where it ended."""

    req_id: str
    reason: str
    error: str | None = None
    stage: str = ""
    num_frames: int = 0


class Ready(msgspec.Struct, tag="ready", omit_defaults=True):
    """An actor's start-up report to its supervisor: ok, or the error that stopped it."""

    stage: str
    pid: int
    ok: bool = True
    error: str | None = None
    info: dict[str, str] = {}


class Stats(msgspec.Struct, tag="stats", omit_defaults=True):
    stage: str
    num_running: int = 0
    num_waiting: int = 0
    num_steps: int = 0
    step_ms: float = 0.0
    extra: dict[str, float] = {}


class Shutdown(msgspec.Struct, tag="shutdown", omit_defaults=True):
    reason: str = "shutdown"


class Credit(msgspec.Struct, tag="credit", omit_defaults=True, gc=False):
    """Client -> server flow control: the client can take ``num_bytes`` more of ``req_id``."""

    req_id: str
    num_bytes: int


Message = Submit | Chunk | Chunks | Abort | Finish | Ready | Stats | Shutdown | Credit

KIND_OF: dict[type, Kind] = {
    Submit: Kind.SUBMIT,
    Chunk: Kind.CHUNK,
    Chunks: Kind.CHUNKS,
    Abort: Kind.ABORT,
    Finish: Kind.FINISH,
    Ready: Kind.READY,
    Stats: Kind.STATS,
    Shutdown: Kind.SHUTDOWN,
    Credit: Kind.CREDIT,
}
TYPE_OF: dict[int, type] = {int(k): t for t, k in KIND_OF.items()}
