"""The bottom layer: errors, atomic I/O, the result schema, units and recipes.

Everything else in llmopt may import from here; nothing here imports from the rest of llmopt.
"""
