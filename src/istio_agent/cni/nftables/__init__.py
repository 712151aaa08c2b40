"""Sidecar capture with native nftables (``--native-nftables``, the plugin's ``native_nftables``).

Istio's ``tools/istio-nftables``: the same capture as the iptables rules, written as three ``inet``
tables through ``nft``. Entry points (imported from their modules, so a dry run loads no applier):

- ``builder.render_config(config)``: the dry run, the ``nft -f`` input as Istio's goldens record it;
- ``apply.apply_nft_capture(config, netns=, cleanup_only=, deadline=)``: applies it in a network
  namespace, idempotently, and returns an ``apply.NftOutcome``.
"""
