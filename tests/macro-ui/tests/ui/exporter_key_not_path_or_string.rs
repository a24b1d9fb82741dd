use kiln::{exporter, ModuleExporter};

#[exporter(keys = ["Linear", 42])]
struct BadKey;
impl ModuleExporter for BadKey {}

fn main() {}
