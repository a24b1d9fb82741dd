use kiln::exporter;

#[exporter(keys = ["Linear"])]
enum NotAStruct {
    A,
}

fn main() {}
