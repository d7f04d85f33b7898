"""The training process's side of the background writer: the ``WriterQueue`` (starting and stopping
the writer process, its socket, its replies), the ``Ledger`` of a Checkpointer's unsettled work, and
the ``SaveHandle`` of each piece of it. Nothing here runs in the writer process (``writer``)."""
