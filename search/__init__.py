"""The differentiable stage/mesh engine (softmax-relaxed assignments, optax).

Not built yet: it is the subject of its own issue. Nothing is exported, so
nothing here pretends to work; ``pipedejavu.solve`` lists the methods that do.
"""

__all__: list[str] = []
