"""SageMaker's TensorFlow API for dataparallel is not provided: only the PyTorch one is, and the script is told so."""

raise ImportError(
    "smdistributed.dataparallel.tensorflow: hpkit's compat layer provides only the PyTorch API (smdistributed.dataparallel.torch); "
    "run a TensorFlow script with tf.distribute or Horovod (launcher: mpi) and drop compat, or port it to PyTorch"
)
