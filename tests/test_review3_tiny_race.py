"""ensure_tiny_checkpoint called at the same time by several threads (thread-placed stages resolve the
checkpoint each) or processes must neither raise nor return a missing/incomplete directory."""

import multiprocessing as mp
import threading

from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint


def _complete(path):
    return all((path / n).is_file() for n in ("config.json", "generation_config.json", "tokenizer.json",
                                               "tokenizer_config.json", "speech_tokenizer/config.json"))


def test_concurrent_threads(tmp_path):
    for round_ in range(5):
        cache = tmp_path / f"c{round_}"
        barrier = threading.Barrier(6)
        results, errors = [], []

        def work():
            barrier.wait()
            try:
                results.append(ensure_tiny_checkpoint("custom_voice", cache_dir=cache))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(set(results)) == 1 and _complete(results[0])
        assert [p.name for p in cache.iterdir()] == [results[0].name]  # no temp dirs left behind


def _proc(cache, q):
    try:
        q.put(str(ensure_tiny_checkpoint("base", cache_dir=cache)))
    except BaseException as exc:  # noqa: BLE001
        q.put(f"ERROR {exc!r}")


def test_concurrent_processes(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_proc, args=(tmp_path, q)) for _ in range(3)]
    for p in procs:
        p.start()
    out = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert not [o for o in out if o.startswith("ERROR")], out
    from pathlib import Path
    assert len(set(out)) == 1 and _complete(Path(out[0]))
