"""Qwen3-TTS-12Hz: config, weights, text prompts, talker + code predictor, sampling, generation.

The speech tokenizer (codec), speaker encoder and audio loading live beside these modules; the step
API the engine runner drives is documented in ``talker.py``.
"""
