"""The ensemble model's code as MLflow logs it ("models from code"): MLflow runs this file to build the model, so
nothing is pickled. Decoding settings come from the logged model config (`launch.model_registry.register_ensemble`)."""
import mlflow.models

from dashboards.leaderboard import A2EnsembleModel

mlflow.models.set_model(A2EnsembleModel())
