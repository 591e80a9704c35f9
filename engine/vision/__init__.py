"""Vision-language models: the supported families and the refused ones (``families``), their
processors (``processing``), images to tensors (``pixels``), a micro-batch's images
(``batch``) and the pipeline's input layer that runs the vision tower (``layer``)."""
