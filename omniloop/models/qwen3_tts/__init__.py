"""Qwen3-TTS-12Hz: config, weights, text prompts, talker + code predictor, sampling, generation.

The speech tokenizer (codec), speaker encoder and audio loading live beside these modules; the step
API the engine runner drives is documented in ``talker.py``.
"""

from omniloop.models.qwen3_tts import family as family  # registers the stages, validator and info
