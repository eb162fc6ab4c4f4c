"""Certified truncation and the bounds it rests on: certified windows (``certified``), a band
certified from the band kernel's own log-sums (``certified_read``), score ceilings
(``ceilings``), the key blocks a certified block-sparse reading reads
(``block_choice``), credible context lengths (``credible``) and the Beta tails and quantiles
behind the geometric–Beta prior's bounds (``beta``)."""
