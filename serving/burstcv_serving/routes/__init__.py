"""Group the service's HTTP routes, one APIRouter per module."""
