"""Mean-field windows: expanding attention's inference scheme (``scheme.py``), its window
rules (``rules.py``), the band's scores (``scores.py``), the Python loop (``loop.py``) and
the compiled kernel's typed interface (``kernel.py``); certified truncation
(``structattn/certificates/certified.py``: ``certify``, its result ``CertifiedWindow``); credible context
lengths from the posterior over q (``structattn/certificates/credible.py``: ``credible_context``)."""

from ..certificates.certified import CertifiedWindow, certify
from ..certificates.credible import CredibleContext, credible_context
from .history import MeanFieldHistory
from .rules import RULES, CertifiedRule, EdgeRule, EvidenceRule, PredictiveRule, Round, WindowRule
from .scheme import MeanFieldOperator, MeanFieldWindows, ScoreFactors

__all__ = ["MeanFieldHistory", "MeanFieldOperator", "MeanFieldWindows", "ScoreFactors", "RULES",
           "WindowRule", "Round", "CertifiedRule", "PredictiveRule", "EdgeRule", "EvidenceRule",
           "certify",
           "CertifiedWindow", "CredibleContext", "credible_context"]
