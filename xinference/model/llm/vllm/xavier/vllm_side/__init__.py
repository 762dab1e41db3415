"""vllm_side"""
