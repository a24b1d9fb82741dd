use kiln::{exporter, ModuleExporter};

#[exporter(keys = ["Linear"])]
struct HasFields {
    n: u32,
}
impl ModuleExporter for HasFields {}

fn main() {}
