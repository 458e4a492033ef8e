"""Communication hooks: one module per hook family, with torch's names and contracts.

Beside them, as in torch: :mod:`~gradcomm.hooks.averagers` (model averaging for post-local SGD), and the hook
contract (:mod:`~gradcomm.hooks.contract`, :mod:`~gradcomm.hooks.fingerprint`: what ranks must agree on).
"""
