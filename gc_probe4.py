import time, numpy as np, torch
from omniloop.gpu.backends import configure_cuda_stage
from omniloop.gpu.sm_partition import PartitionedStream
from omniloop.models.qwen3_tts.speech_stream import CodecStreams
from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint
import sys
configure_cuda_stage()
mode, bench, graphs = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
torch.backends.cudnn.benchmark = bench
tok = SpeechTokenizer.load(ensure_tiny_checkpoint("custom_voice", size="1.7b"), device="cuda", dtype=torch.bfloat16, load_format="dummy", with_encoder=False)
part = None if mode == "all" else PartitionedStream(int(mode), torch.device("cuda"))
stream = torch.cuda.Stream() if part is None else part.stream
rng = np.random.default_rng(0)
streams = CodecStreams(tok.decoder, max_streams=64, initial_slots=64, graphs=graphs, capture_stream=stream)
chunks = [(f"r{i}", rng.integers(0, 2048, (8, 16), dtype=np.int64)) for i in range(64)]
for r, _ in chunks: streams.open(r)
with torch.cuda.stream(stream), torch.inference_mode():
    for _ in range(2): streams.decode_host(chunks)
    t = time.perf_counter()
    for _ in range(3): streams.decode_host(chunks)
print(f"sms={mode} benchmark={bench} graphs={graphs}: {(time.perf_counter()-t)/3*1e3:.1f} ms/step", flush=True)
if mode != "all" and not graphs:
    from torch.profiler import profile, ProfilerActivity
    with torch.cuda.stream(stream), torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as p:
        streams.decode_host(chunks)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=6), flush=True)
