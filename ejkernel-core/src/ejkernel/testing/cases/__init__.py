"""Conformance examples of the built-in ops, one module per op (``OpSpec.examples`` names
``ejkernel.testing.cases.<op>:examples``).

Each ``examples()`` returns a short curated list: the odd sizes (sequence 37 and 129, head dim
80, GQA/MQA) and every option of the op, several options per example so the default run stays
fast; examples marked ``thorough`` run with ``--ejkernel-thorough``.
"""
