use kiln::{architecture, Architecture, ArchitectureError, ModuleTree, TensorInfo};

#[architecture(priority = 1)]
struct Family;
impl Architecture for Family {
    fn module_tree(&self, _: &serde_json::Value, _: &[TensorInfo]) -> Result<ModuleTree, ArchitectureError> {
        Ok(ModuleTree::default())
    }
}

fn main() {}
