"""sglang_r3.tools."""
