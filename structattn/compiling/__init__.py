"""What a compiled module does per call: a family's operator (``lowering``), its plans per
input signature (``replay``; the plans' parts are ``structattn.plans``) and what a call
reports (``trace``)."""
