"""fastzero's thin ZeRO runtime (issue 4, in progress): so far the loss
scaler and the learning-rate schedules that the engine will drive."""
