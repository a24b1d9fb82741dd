use kiln::{exporter, ModuleExporter};

#[exporter(keys = ["Linear"], prepend = true)]
struct FlagValue;
impl ModuleExporter for FlagValue {}

fn main() {}
