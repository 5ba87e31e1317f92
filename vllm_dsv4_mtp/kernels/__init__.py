"""The two platform seams: attention core (``attention_core``) and routed-expert GEMMs (``experts``)."""
